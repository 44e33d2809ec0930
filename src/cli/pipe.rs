//! `hcp-sense pipe`: runs a `sense_only` pack's command and hands each JSON line it prints to a server as a trigger, one at a time, so a slow server slows the command (its stdout pipe fills) instead of queueing without bound.
use std::process::Stdio;
use std::time::Duration;

use hcp_sense_api::v1::{
    deliver_trigger_request::PayloadSource, ingest_service_client::IngestServiceClient,
    DeliverTriggerRequest,
};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tonic::Code;
use tonic_types::StatusExt;

use super::ServerArgs;

/// Options of `hcp-sense pipe`.
#[derive(Debug, Clone, clap::Args)]
pub struct PipeArgs {
    /// The server, and a `runtime` role's token for it.
    #[command(flatten)]
    pub server: ServerArgs,
    /// The pack whose command this is.
    #[arg(long)]
    pub pack: String,
    /// The principal its triggers are for.
    #[arg(long)]
    pub principal: String,
    /// The land of a line that names none.
    #[arg(long, default_value = "user")]
    pub land: String,
    /// How long a line is retried while the server is unavailable before `pipe` gives up.
    #[arg(long, default_value_t = 30)]
    pub retry_secs: u64,
    /// The command and its arguments.
    #[arg(required = true, last = true)]
    pub command: Vec<String>,
}

/// What became of the lines.
#[derive(Debug, Default)]
struct Tally {
    lines: u64,
    recorded: u64,
    dropped: u64,
    refused: u64,
}

/// Reads one line as a trigger: a JSON object with `ref` and optionally `payload` (an object),
/// `trigger_id`, `project` and `land`. A line without a trigger id gets one, so that a retry
/// after the server was unavailable records it once.
fn trigger(a: &PipeArgs, line: &str) -> Result<DeliverTriggerRequest, String> {
    let v: Value = serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
    let Value::Object(o) = v else {
        return Err("not a JSON object".into());
    };
    let text = |k: &str| -> Result<String, String> {
        match o.get(k) {
            None | Some(Value::Null) => Ok(String::new()),
            Some(Value::String(s)) => Ok(s.clone()),
            Some(_) => Err(format!("`{k}` is not a string")),
        }
    };
    let r#ref = text("ref")?;
    if r#ref.is_empty() {
        return Err("`ref` is required".into());
    }
    let payload = match o.get("payload") {
        None | Some(Value::Null) => None,
        // As JSON text: passed on exactly, numbers and all.
        Some(p @ Value::Object(_)) => Some(PayloadSource::PayloadJson(p.to_string())),
        Some(_) => return Err("`payload` is not a JSON object".into()),
    };
    let trigger_id = match text("trigger_id")? {
        id if id.is_empty() => format!("pipe-{}", uuid::Uuid::now_v7()),
        id => id,
    };
    let land = match text("land")? {
        l if l.is_empty() => a.land.clone(),
        l => l,
    };
    Ok(DeliverTriggerRequest {
        pack_id: a.pack.clone(),
        r#ref,
        principal: a.principal.clone(),
        land,
        payload_source: payload,
        project: text("project")?,
        trigger_id,
        ..Default::default()
    })
}

/// Runs the command and delivers its lines; returns the exit code to leave with: the
/// command's, or 1 when it succeeded but a line could not be delivered.
pub async fn run(a: PipeArgs) -> anyhow::Result<i32> {
    let server = a.server.connect()?;
    let mut client = IngestServiceClient::new(server.channel.clone());
    let (program, args) = a
        .command
        .split_first()
        .ok_or_else(|| anyhow::anyhow!("no command given after `--`"))?;
    let mut child = tokio::process::Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| anyhow::anyhow!("starting `{program}`: {e}"))?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| anyhow::anyhow!("no stdout of `{program}`"))?;
    let mut lines = BufReader::new(stdout).lines();
    let mut tally = Tally::default();
    let mut n = 0u64;
    let mut undelivered = false;
    while let Some(line) = lines.next_line().await? {
        n += 1;
        if line.trim().is_empty() {
            continue;
        }
        tally.lines += 1;
        let req = match trigger(&a, &line) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("hcp-sense pipe: line {n}: {e}");
                tally.refused += 1;
                continue;
            }
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(a.retry_secs);
        let mut pause = Duration::from_millis(100);
        loop {
            match client.deliver_trigger(server.request(req.clone())).await {
                Ok(r) => {
                    if r.into_inner().record_id.is_empty() {
                        tally.dropped += 1;
                    } else {
                        tally.recorded += 1;
                    }
                    break;
                }
                // Over a quota: the line waits the delay it is told, however long, and holds
                // the command's output meanwhile (it is backpressure, not an outage).
                Err(s)
                    if s.code() == Code::ResourceExhausted
                        && s.get_details_retry_info().is_some() =>
                {
                    let delay = s
                        .get_details_retry_info()
                        .and_then(|r| r.retry_delay)
                        .unwrap_or(pause);
                    tokio::time::sleep(delay.max(Duration::from_millis(1))).await;
                }
                Err(s)
                    if matches!(s.code(), Code::Unavailable | Code::ResourceExhausted)
                        && tokio::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(2));
                }
                Err(s) if s.code() == Code::InvalidArgument || s.code() == Code::AlreadyExists => {
                    eprintln!("hcp-sense pipe: line {n}: {}", s.message());
                    tally.refused += 1;
                    break;
                }
                Err(s) => {
                    eprintln!(
                        "hcp-sense pipe: line {n}: not delivered ({:?}): {}; stopping `{program}`",
                        s.code(),
                        s.message()
                    );
                    undelivered = true;
                    break;
                }
            }
        }
        if undelivered {
            let _ = child.kill().await;
            break;
        }
    }
    let status = child.wait().await?;
    eprintln!(
        "hcp-sense pipe: {} lines: {} recorded, {} dropped, {} refused",
        tally.lines, tally.recorded, tally.dropped, tally.refused
    );
    let code = status.code().unwrap_or(1);
    Ok(if undelivered && code == 0 { 1 } else { code })
}
