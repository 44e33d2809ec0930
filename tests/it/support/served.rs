//! The real `hcp-sense` binary served on ephemeral ports.
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_hcp-sense");

/// `hcp-sense serve` on `url`, gRPC and metrics on ephemeral loopback ports.
pub fn serve_command(url: &str) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args([
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        "--database-url",
        url,
    ]);
    cmd
}

/// A `hcp-sense serve` process on an ephemeral port; killed when dropped.
pub struct Served {
    child: Child,
    pub addr: String,
    pub metrics_addr: String,
    /// Every line the server wrote to stdout so far.
    pub log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Served {
    pub fn start(url: &str, extra: &[&str]) -> Served {
        let mut cmd = serve_command(url);
        cmd.args(extra);
        Served::spawn(cmd)
    }

    /// Starts the command and waits for the address it reports.
    pub fn spawn(mut cmd: Command) -> Served {
        if cmd.get_envs().all(|(k, _)| k != "RUST_LOG") {
            cmd.env("RUST_LOG", "info");
        }
        let mut child = cmd
            .env_remove("DATABASE_URL")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start hcp-sense");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Ok(mut l) = sink.lock() {
                    l.push(line.clone());
                }
                if line.contains("hcp-sense listening") {
                    let field = |name: &str| {
                        line.split(name)
                            .nth(1)
                            .and_then(|v| v.split_whitespace().next())
                            .unwrap_or("")
                            .to_owned()
                    };
                    let _ = tx.send((field(" addr="), field("metrics_addr=")));
                }
            }
        });
        let (addr, metrics_addr) = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(a) => a,
            Err(e) => {
                // Say why: the exit status (or that it still runs) and what it logged.
                let status = child.try_wait();
                let _ = child.kill();
                let lines = log.lock().map(|l| l.join("\n")).unwrap_or_default();
                panic!("the server did not report its address ({e}); exit: {status:?}; stdout:\n{lines}")
            }
        };
        Served {
            child,
            addr,
            metrics_addr,
            log,
        }
    }

    /// SIGKILL: no shutdown, no flush.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends SIGTERM and returns whether the process exited 0 within the timeout.
    pub fn terminate(self) -> bool {
        self.terminate_timed().0
    }

    /// Sends SIGTERM; whether the process exited 0 (within 15 s), and how long it took.
    pub fn terminate_timed(mut self) -> (bool, Duration) {
        let pid = self.child.id().to_string();
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("kill");
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(15) {
            if let Ok(Some(status)) = self.child.try_wait() {
                return (status.success(), start.elapsed());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        (false, start.elapsed())
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
