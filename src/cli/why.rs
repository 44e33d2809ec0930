//! `hcp-sense why`: asks a server's decision log what it decided for a trigger (by pack and trigger id, or a principal's over a time), and prints each entry with the check that decided it.
use hcp_sense_api::v1::{
    decision_service_client::DecisionServiceClient, Decision, DecisionOutcome, DropReason,
    GetDecisionRequest, ListDecisionsRequest,
};

use super::ServerArgs;

/// Options of `hcp-sense why`.
#[derive(Debug, Clone, clap::Args)]
pub struct WhyArgs {
    /// The server, and an `admin` token (or a `reader`'s, for its own decisions).
    #[command(flatten)]
    pub server: ServerArgs,
    /// The trigger's pack.
    #[arg(long)]
    pub pack: Option<String>,
    /// The trigger id the producer gave: its newest entry.
    #[arg(long)]
    pub trigger_id: Option<String>,
    /// Whose decisions (without --trigger-id): the newest first.
    #[arg(long)]
    pub principal: Option<String>,
    /// Only those decided this long ago or less (an age: 30m, 2h, 1d).
    #[arg(long, value_parser = since)]
    pub since: Option<std::time::Duration>,
    /// Most entries to print (without --trigger-id).
    #[arg(long, default_value_t = 20)]
    pub limit: i32,
    /// Print the entries as JSON instead.
    #[arg(long)]
    pub json: bool,
}

fn since(s: &str) -> Result<std::time::Duration, String> {
    crate::domain::model::parse_age(s)?.ok_or_else(|| "must be longer than 0".to_owned())
}

/// Asks and prints; the answer's text, or the server's refusal as an error.
pub async fn run(a: WhyArgs) -> anyhow::Result<String> {
    let server = a.server.connect()?;
    let mut client = DecisionServiceClient::new(server.channel.clone());
    let status = |s: tonic::Status| anyhow::anyhow!("{:?}: {}", s.code(), s.message());
    let entries = match (&a.pack, &a.trigger_id) {
        (Some(pack), Some(id)) => client
            .get_decision(server.request(GetDecisionRequest {
                pack_id: pack.clone(),
                trigger_id: id.clone(),
                ..Default::default()
            }))
            .await
            .map_err(status)?
            .into_inner()
            .decision
            .into_iter()
            .collect::<Vec<_>>(),
        (None, Some(_)) => anyhow::bail!("--trigger-id needs --pack: trigger ids are a pack's"),
        _ => {
            if a.principal.is_none() && a.pack.is_none() {
                anyhow::bail!(
                    "name a trigger (--pack and --trigger-id), a --principal or a --pack"
                );
            }
            let start_time = a.since.map(|age| {
                let t = std::time::SystemTime::now() - age;
                prost_types::Timestamp::from(t)
            });
            client
                .list_decisions(server.request(ListDecisionsRequest {
                    pack_id: a.pack.clone().unwrap_or_default(),
                    principal: a.principal.clone().unwrap_or_default(),
                    start_time,
                    page_size: a.limit,
                    ..Default::default()
                }))
                .await
                .map_err(status)?
                .into_inner()
                .decisions
        }
    };
    Ok(if a.json {
        serde_json::Value::Array(entries.iter().map(json).collect()).to_string()
    } else if entries.is_empty() {
        "no decision is kept for that".to_owned()
    } else {
        entries.iter().map(text).collect::<Vec<_>>().join("\n")
    })
}

fn outcome(d: &Decision) -> String {
    let reason = DropReason::try_from(d.drop_reason)
        .map(|r| {
            r.as_str_name()
                .trim_start_matches("DROP_REASON_")
                .to_ascii_lowercase()
        })
        .unwrap_or_default();
    match DecisionOutcome::try_from(d.outcome) {
        Ok(DecisionOutcome::Inbox) => "recorded (inbox)".into(),
        Ok(DecisionOutcome::Silent) => "recorded (silent)".into(),
        Ok(DecisionOutcome::Dropped) => format!("dropped: {reason}"),
        Ok(DecisionOutcome::Refused) => "refused before the decision".into(),
        Ok(DecisionOutcome::Duplicate) => "a duplicate, answered with its first record".into(),
        _ => "unknown".into(),
    }
}

fn when(d: &Decision) -> String {
    d.decide_time
        .as_ref()
        .and_then(|t| {
            let secs = u64::try_from(t.seconds).ok()?;
            let at = std::time::UNIX_EPOCH
                + std::time::Duration::new(secs, u32::try_from(t.nanos).unwrap_or(0));
            Some(humantime::format_rfc3339_millis(at).to_string())
        })
        .unwrap_or_default()
}

/// One entry as an operator reads it.
pub fn text(d: &Decision) -> String {
    let mut out = format!(
        "{} {} {} for {} (ref {}, land {}) from {}: {}\n",
        when(d),
        d.pack_id,
        if d.trigger_id.is_empty() {
            "(no trigger id)".to_owned()
        } else {
            format!("trigger {}", d.trigger_id)
        },
        d.principal,
        d.r#ref,
        d.land,
        d.source,
        outcome(d)
    );
    if !d.check.is_empty() {
        out.push_str(&format!("  decided by {}: {}\n", d.check, d.detail));
    }
    if !d.record_id.is_empty() {
        out.push_str(&format!("  record {}\n", d.record_id));
    }
    if d.folded > 0 {
        out.push_str(&format!(
            "  and {} more decisions like it in the same second, folded into this entry\n",
            d.folded
        ));
    }
    if !d.trace_id.is_empty() {
        out.push_str(&format!("  trace {}\n", d.trace_id));
    }
    out
}

fn json(d: &Decision) -> serde_json::Value {
    serde_json::json!({
        "decision_id": d.decision_id,
        "decide_time": when(d),
        "pack_id": d.pack_id,
        "ref": d.r#ref,
        "principal": d.principal,
        "land": d.land,
        "project": d.project,
        "binding_id": d.binding_id,
        "trigger_id": d.trigger_id,
        "source": d.source,
        "outcome": outcome(d),
        "check": d.check,
        "detail": d.detail,
        "record_id": d.record_id,
        "trace_id": d.trace_id,
        "folded": d.folded,
    })
}
