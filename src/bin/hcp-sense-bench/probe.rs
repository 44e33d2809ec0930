//! The probe: Health/Check and a quiet pack's DeliverTrigger called at a steady pace from a process of its own, on one thread, so that a flood driven from the benchmark's process does not slow the very calls that measure it.
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tonic::transport::Channel;

use crate::flood::{paced, Call, Paced};
use crate::load::Population;
use crate::Options;

/// One series as the probe reports it: latencies in milliseconds (NaN when no call was
/// answered), the calls answered and the errors.
#[derive(Clone, Copy, Debug)]
pub struct Series {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
    pub calls: u64,
    pub errors: u64,
}

impl Series {
    fn of(p: &Paced) -> Series {
        Series {
            p50: p.pct(0.5),
            p90: p.pct(0.9),
            p99: p.pct(0.99),
            max: p.pct(1.0),
            calls: p.calls as u64,
            errors: p.errors as u64,
        }
    }

    /// As the probe prints it; a NaN becomes null.
    pub fn to_json(self) -> serde_json::Value {
        json!({
            "p50_ms": self.p50, "p90_ms": self.p90, "p99_ms": self.p99, "max_ms": self.max,
            "calls": self.calls, "errors": self.errors,
        })
    }

    /// As `to_json` wrote it; a latency absent or null (no call answered) reads as NaN.
    fn from_json(v: &serde_json::Value) -> Series {
        let ms = |k: &str| v[k].as_f64().unwrap_or(f64::NAN);
        let n = |k: &str| v[k].as_u64().unwrap_or(0);
        Series {
            p50: ms("p50_ms"),
            p90: ms("p90_ms"),
            p99: ms("p99_ms"),
            max: ms("max_ms"),
            calls: n("calls"),
            errors: n("errors"),
        }
    }
}

/// What one probe process measured, over the same span.
#[derive(Clone, Copy, Debug)]
pub struct Probed {
    pub health: Series,
    pub quiet: Series,
}

impl Probed {
    pub fn to_json(self) -> serde_json::Value {
        json!({ "health": self.health.to_json(), "quiet": self.quiet.to_json() })
    }
}

async fn connect(addr: &str) -> anyhow::Result<Channel> {
    Ok(Channel::from_shared(format!("http://{addr}"))?
        .connect()
        .await?)
}

/// The probe's process (`--probe-addr`): for `--probe-secs`, pack `--probe-pack`'s
/// DeliverTrigger and Health/Check, each every `--probe-every-ms` on a connection of its own
/// (as the flood phase's in-process series are), then one JSON line on stdout with both.
pub async fn run(o: &Options, addr: &str) -> anyhow::Result<()> {
    let pop = o.population(o.principals);
    let (quiet_ch, health_ch) = (connect(addr).await?, connect(addr).await?);
    let every = Duration::from_millis(o.probe_every_ms.max(1));
    let stop = Arc::new(AtomicBool::new(false));
    let quiet = tokio::spawn(paced(
        quiet_ch,
        Call::Deliver(o.probe_pack),
        pop,
        every,
        stop.clone(),
        o.probe_tag.clone(),
    ));
    let health = tokio::spawn(paced(
        health_ch,
        Call::Health,
        pop,
        every,
        stop.clone(),
        String::new(),
    ));
    tokio::time::sleep(Duration::from_secs(o.probe_secs)).await;
    stop.store(true, Ordering::Relaxed);
    let probed = Probed {
        quiet: Series::of(&quiet.await?),
        health: Series::of(&health.await?),
    };
    println!("{}", probed.to_json());
    Ok(())
}

/// Runs the probe as a child process of this binary against the server at `addr` for `secs`:
/// pack `pack` of `pop` and Health/Check, each every `every_ms`, its trigger ids prefixed
/// `tag` (one of its own per run on that server); returns the line it prints.
pub async fn spawn(
    addr: &str,
    pop: Population,
    pack: usize,
    (secs, every_ms): (u64, u64),
    tag: &str,
) -> anyhow::Result<Probed> {
    let mut cmd = tokio::process::Command::new(std::env::current_exe()?);
    for (flag, value) in [
        ("--probe-addr", addr.to_owned()),
        ("--probe-pack", pack.to_string()),
        ("--probe-every-ms", every_ms.to_string()),
        ("--probe-secs", secs.to_string()),
        ("--probe-tag", tag.to_owned()),
        // The population the quiet pack's triggers are drawn from (`flood::of_pack`).
        ("--packs", pop.packs.to_string()),
        ("--principals", pop.principals.to_string()),
    ] {
        cmd.arg(flag).arg(value);
    }
    let out = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        // Its errors, if any, among the benchmark's own.
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()?
        .wait_with_output()
        .await?;
    anyhow::ensure!(
        out.status.success(),
        "the probe process failed: {}",
        out.status
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .ok_or_else(|| anyhow::anyhow!("the probe process printed no result"))?;
    let v: serde_json::Value = serde_json::from_str(line)?;
    Ok(Probed {
        health: Series::from_json(&v["health"]),
        quiet: Series::from_json(&v["quiet"]),
    })
}
