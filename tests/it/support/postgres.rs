//! A PostgreSQL server of a test's own, to stop and start without touching other tests.
use std::path::PathBuf;
use std::process::Command;

/// A PostgreSQL server of this test's own (initdb into a temporary directory, its own port), so
/// that stopping it touches no other test.
pub struct PrivatePostgres {
    dir: PathBuf,
    bin: PathBuf,
    port: u16,
}

impl PrivatePostgres {
    pub fn start() -> PrivatePostgres {
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .expect("PostgreSQL server binaries under /usr/lib/postgresql (see .ci/run)")
            .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
            .filter(|p| p.join("pg_ctl").exists())
            .max()
            .expect("pg_ctl");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let dir = std::env::temp_dir().join(format!("hcp-sense-pg-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        // TLS (server.pem, server.key), so that clients can ask for sslmode=require.
        crate::security::make_certs(&dir);
        let pg = PrivatePostgres { dir, bin, port };
        if is_root() {
            let ok = Command::new("chown")
                .args(["-R", "postgres:"])
                .arg(&pg.dir)
                .status()
                .expect("chown");
            assert!(ok.success(), "chown to postgres");
        }
        pg.run(
            "initdb",
            &[
                "-D",
                &pg.data(),
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
                "-E",
                "UTF8",
            ],
        );
        pg.up();
        pg
    }

    pub fn data(&self) -> String {
        self.dir.join("data").display().to_string()
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Runs one of PostgreSQL's programs, as the postgres user when we are root.
    pub fn run(&self, program: &str, args: &[&str]) {
        let exe = self.bin.join(program);
        let mut cmd = if is_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&exe);
            c
        } else {
            Command::new(&exe)
        };
        let o = cmd.args(args).output().expect(program);
        assert!(
            o.status.success(),
            "{program} {args:?}: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
    }

    pub fn up(&self) {
        let opts = format!(
            "-p {port} -k {dir} -c listen_addresses=127.0.0.1 -c fsync=off -c ssl=on \
             -c ssl_cert_file={dir}/server.pem -c ssl_key_file={dir}/server.key",
            port = self.port,
            dir = self.dir.display()
        );
        let log = self.dir.join("log").display().to_string();
        self.run(
            "pg_ctl",
            &["-D", &self.data(), "-o", &opts, "-l", &log, "-w", "start"],
        );
    }

    /// A fast shutdown: sessions are terminated, transactions in flight roll back.
    pub fn down(&self) {
        self.run("pg_ctl", &["-D", &self.data(), "-m", "fast", "-w", "stop"]);
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let exe = self.bin.join("pg_ctl");
        let data = self.data();
        let _ = if is_root() {
            Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .arg(&exe)
                .args(["-D", &data, "-m", "immediate", "stop"])
                .output()
        } else {
            Command::new(&exe)
                .args(["-D", &data, "-m", "immediate", "stop"])
                .output()
        };
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}
