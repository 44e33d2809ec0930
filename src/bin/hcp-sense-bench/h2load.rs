//! h2load (nghttp2's HTTP/2 load generator) as the flood's client when it is on PATH: one C thread keeping the flood's streams busy, meant to weigh on the cores the server shares far less than as many tonic callers in the benchmark's own runtime.
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::str::FromStr;

use prost::Message;

use crate::pb::DeliverTriggerRequest;

/// h2load on PATH, if it is installed (Debian's nghttp2-client).
pub fn find() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join("h2load"))
        .find(|f| f.is_file())
}

/// `req` as one gRPC message on the wire: not compressed (0), its length as a big-endian u32,
/// then the message.
pub fn grpc_frame(req: &impl Message) -> anyhow::Result<Vec<u8>> {
    let msg = req.encode_to_vec();
    let mut out = Vec::with_capacity(5 + msg.len());
    out.push(0);
    out.extend_from_slice(&u32::try_from(msg.len())?.to_be_bytes());
    out.extend_from_slice(&msg);
    Ok(out)
}

/// What h2load's summary says of a run.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Summary {
    /// Requests a second over the measured span (the warm-up not counted). Every answer with
    /// HTTP status 200 counts: h2load reads no trailers, so a gRPC error counts as well.
    pub per_sec: f64,
    pub succeeded: u64,
    /// Failed, errored or timed out.
    pub failed: u64,
    /// Answered with an HTTP status other than 2xx.
    pub not_2xx: u64,
}

/// The number before `word` in one of `line`'s comma-separated parts ("9615 succeeded").
fn count<T: FromStr>(line: &str, word: &str) -> Option<T> {
    line.split([':', ','])
        .find_map(|part| part.trim().strip_suffix(word)?.trim().parse().ok())
}

/// Reads h2load's summary: "finished in 5.00s, 12345.60 req/s, …", "requests: … N succeeded,
/// N failed, N errored, N timeout" and "status codes: N 2xx, N 3xx, N 4xx, N 5xx".
pub fn summary(text: &str) -> Option<Summary> {
    let line = |prefix: &str| text.lines().find(|l| l.starts_with(prefix));
    let (finished, requests, codes) = (
        line("finished in")?,
        line("requests:")?,
        line("status codes:")?,
    );
    let sum = |line: &str, words: &[&str]| -> Option<u64> {
        words.iter().map(|w| count::<u64>(line, w)).sum()
    };
    Some(Summary {
        per_sec: count(finished, "req/s")?,
        succeeded: count(requests, "succeeded")?,
        failed: sum(requests, &["failed", "errored", "timeout"])?,
        not_2xx: sum(codes, &["3xx", "4xx", "5xx"])?,
    })
}

/// The streams an hcp-sense connection may hold open at once: its --max-concurrent-streams
/// default.
const SERVER_STREAMS: usize = 256;

/// The file h2load posts; removed when the flood is over, however it ends.
struct Body(PathBuf);

impl Drop for Body {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// One h2load flood under way.
pub struct Flood {
    child: tokio::process::Child,
    _body: Body,
    pub connections: usize,
    /// Streams each connection keeps busy: a closed loop each, as a tonic caller is.
    pub streams: usize,
}

impl Flood {
    /// Starts h2load against the server at `addr`: `callers` streams over `connections` (more
    /// when a connection would hold more streams than the server allows), each sending `req`
    /// to DeliverTrigger again as soon as it is answered, for `warm_up` seconds and then
    /// `measured` seconds, the only ones its rate counts. hcp-sense serves the benchmark on
    /// loopback without `[auth]`, so the calls carry no authorization header.
    pub fn start(
        h2load: &Path,
        addr: &str,
        req: &DeliverTriggerRequest,
        (callers, connections): (usize, usize),
        (warm_up, measured): (u64, u64),
    ) -> anyhow::Result<Flood> {
        let connections = connections.max(callers.div_ceil(SERVER_STREAMS)).max(1);
        let streams = callers.div_ceil(connections).max(1);
        let body = Body(
            std::env::temp_dir().join(format!("hcp_sense_bench_{}_flood.grpc", std::process::id())),
        );
        std::fs::write(&body.0, grpc_frame(req)?)?;
        let child = tokio::process::Command::new(h2load)
            .arg("--duration")
            .arg(measured.to_string())
            .arg("--warm-up-time")
            .arg(warm_up.to_string())
            .arg("--clients")
            .arg(connections.to_string())
            .arg("--max-concurrent-streams")
            .arg(streams.to_string())
            .arg("--data")
            .arg(&body.0)
            .args(["-H", "content-type: application/grpc", "-H", "te: trailers"])
            .arg(format!(
                "http://{addr}/hcp.sense.v1.IngestService/DeliverTrigger"
            ))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| anyhow::anyhow!("starting {}: {e}", h2load.display()))?;
        Ok(Flood {
            child,
            _body: body,
            connections,
            streams,
        })
    }

    /// Waits for h2load to end; its summary. A run that sent nothing (it could not connect)
    /// is an error.
    pub async fn finish(self) -> anyhow::Result<Summary> {
        let out = self.child.wait_with_output().await?;
        summary(&String::from_utf8_lossy(&out.stdout))
            .filter(|s| out.status.success() && s.succeeded > 0)
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "h2load sent no flood ({}): {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                )
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_summary_of_a_timed_run() {
        let text = "\
finished in 3.00s, 3920.50 req/s, 238.49KB/s
requests: 7841 total, 7841 started, 7841 done, 7839 succeeded, 2 failed, 1 errored, 0 timeout
status codes: 7839 2xx, 0 3xx, 2 4xx, 0 5xx
traffic: 476.98KB (488427) total, 37.84KB (38748) headers (space savings 96.28%), 62.82KB (64330) data
";
        assert_eq!(
            summary(text),
            Some(Summary {
                per_sec: 3920.5,
                succeeded: 7839,
                failed: 3,
                not_2xx: 2,
            })
        );
        assert_eq!(summary("starting benchmark..."), None);
    }

    #[test]
    fn frames_a_message_as_grpc_does() {
        let req = DeliverTriggerRequest {
            pack_id: "pack-0".into(),
            ..Default::default()
        };
        let msg = req.encode_to_vec();
        let framed = grpc_frame(&req).ok();
        let mut want = vec![0, 0, 0, 0, msg.len() as u8];
        want.extend_from_slice(&msg);
        assert_eq!(framed, Some(want));
    }
}
