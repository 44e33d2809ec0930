//! CPU time of the processes a phase runs on: the server, PostgreSQL's processes and this client.
//! When they share the cores, this is what bounds a ratio, and where it goes.

/// /proc reports process times in USER_HZ, 100 on every Linux architecture this runs on.
const USER_HZ: f64 = 100.0;

/// CPU seconds used so far, by process group.
#[derive(Clone, Copy, Default)]
pub struct Cpu {
    pub server: f64,
    pub postgres: f64,
    pub client: f64,
}

/// utime + stime of a process (all its threads), in seconds.
pub fn seconds(stat: &str) -> Option<f64> {
    // The command name may hold spaces and parentheses: fields count from the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let mut f = rest.split_whitespace();
    let utime: f64 = f.nth(11)?.parse().ok()?;
    let stime: f64 = f.next()?.parse().ok()?;
    Some((utime + stime) / USER_HZ)
}

fn of(pid: &str) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| seconds(&s))
        .unwrap_or(0.0)
}

/// CPU seconds of the threads of `pid` whose name starts with one of `prefixes`.
pub fn threads(pid: u32, prefixes: &[&str]) -> f64 {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0.0;
    };
    dir.flatten()
        .filter(|t| {
            let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
            prefixes.iter().any(|p| comm.starts_with(p))
        })
        .filter_map(|t| std::fs::read_to_string(t.path().join("stat")).ok())
        .filter_map(|s| seconds(&s))
        .sum()
}

/// The CPU seconds of every process named `postgres`.
pub fn postgres() -> f64 {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0.0;
    };
    dir.flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|pid| pid.bytes().all(|b| b.is_ascii_digit()))
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|c| c.trim_end() == "postgres")
        })
        .map(|pid| of(&pid))
        .sum()
}

/// The CPU seconds of this process.
pub fn client() -> f64 {
    of("self")
}

/// Now, for the server `server_pid`, every process named `postgres`, and this process.
pub fn sample(server_pid: u32) -> Cpu {
    Cpu {
        server: of(&server_pid.to_string()),
        postgres: postgres(),
        client: client(),
    }
}

impl Cpu {
    /// Microseconds per call of each group between `self` and `later`.
    pub fn per_call(&self, later: &Cpu, calls: usize) -> Cpu {
        let n = calls.max(1) as f64 / 1e6;
        Cpu {
            server: (later.server - self.server) / n,
            postgres: (later.postgres - self.postgres) / n,
            client: (later.client - self.client) / n,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_count_from_the_last_parenthesis() {
        let stat = "42 (a (b) c) S 1 42 42 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 1 0";
        assert_eq!(seconds(stat), Some(3.0));
    }
}
