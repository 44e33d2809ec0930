//! The `hcp-sense` server processes the benchmark measures: started, scraped and stopped from outside.
use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tonic::transport::Channel;

/// The `hcp-sense` binary: the one given, or the one next to this benchmark's own binary (both
/// land in the same target directory when the workspace is built).
pub fn find_binary(given: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(p) = given {
        return Ok(p.to_path_buf());
    }
    let me = std::env::current_exe()?;
    let next = me.with_file_name("hcp-sense");
    if next.is_file() {
        Ok(next)
    } else {
        anyhow::bail!(
            "no hcp-sense binary next to {}: build it (`cargo build --release`) or pass --server-bin",
            me.display()
        )
    }
}

/// `hcp-sense migrate up`: the schema the bulk path writes into.
pub fn migrate(bin: &Path, url: &str) -> anyhow::Result<()> {
    let out = Command::new(bin)
        .args(["migrate", "up", "--database-url", url])
        .env_remove("DATABASE_URL")
        .output()?;
    if !out.status.success() {
        anyhow::bail!(
            "hcp-sense migrate up failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// A running `hcp-sense serve` on ephemeral ports; killed when dropped.
pub struct Server {
    child: Child,
    pub addr: String,
    metrics: String,
}

impl Server {
    pub fn start(bin: &Path, url: &str, extra: &[&str]) -> anyhow::Result<Server> {
        Server::start_env(bin, url, extra, &[])
    }

    pub fn start_env(
        bin: &Path,
        url: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> anyhow::Result<Server> {
        let mut child = Command::new(bin)
            .envs(env.iter().copied())
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--metrics-listen",
                "127.0.0.1:0",
                "--database-url",
                url,
                "--bench-baseline",
                "true",
            ])
            .args(extra)
            // The server's own RUST_LOG (default warn), plus the line that tells its address.
            .env(
                "RUST_LOG",
                format!(
                    "{},hcp_sense::app=info",
                    std::env::var("HCP_SENSE_BENCH_SERVER_LOG").unwrap_or_else(|_| "warn".into())
                ),
            )
            .env_remove("DATABASE_URL")
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| anyhow::anyhow!("starting {}: {e}", bin.display()))?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| anyhow::anyhow!("no stdout"))?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let word = |key: &str| {
                    line.split(key)
                        .nth(1)
                        .and_then(|a| a.split_whitespace().next())
                        .map(str::to_owned)
                };
                match (word(" addr="), word("metrics_addr=")) {
                    (Some(a), Some(m)) => {
                        let _ = tx.send((a, m));
                    }
                    // The server's own log lines go to stderr.
                    _ => eprintln!("{line}"),
                }
            }
        });
        let (addr, metrics) = rx
            .recv_timeout(Duration::from_secs(120))
            .map_err(|_| anyhow::anyhow!("the server did not report its address"))?;
        Ok(Server {
            child,
            addr,
            metrics,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Resident and peak resident set size in KiB, from /proc.
    pub fn rss_kib(&self) -> (u64, u64) {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default();
        let get = |k: &str| {
            status
                .lines()
                .find(|l| l.starts_with(k))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        (get("VmRSS:"), get("VmHWM:"))
    }

    /// The server's Prometheus samples: `name{labels}` to value.
    pub async fn scrape(&self) -> HashMap<String, f64> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut out = HashMap::new();
        let Ok(mut s) = tokio::net::TcpStream::connect(&self.metrics).await else {
            return out;
        };
        let req = format!(
            "GET /metrics HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
            self.metrics
        );
        let mut text = String::new();
        if s.write_all(req.as_bytes()).await.is_err() || s.read_to_string(&mut text).await.is_err()
        {
            return out;
        }
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            if let Some((k, v)) = line.rsplit_once(' ') {
                if let Ok(v) = v.parse() {
                    out.insert(k.to_owned(), v);
                }
            }
        }
        out
    }

    /// `n` HTTP/2 connections to the server.
    pub async fn channels(&self, n: usize) -> anyhow::Result<Vec<Channel>> {
        let mut v = Vec::new();
        for _ in 0..n.max(1) {
            v.push(
                Channel::from_shared(format!("http://{}", self.addr))?
                    .connect()
                    .await?,
            );
        }
        Ok(v)
    }

    /// SIGTERM, and waits for the graceful shutdown.
    pub fn stop(mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
