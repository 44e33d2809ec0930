//! `hcp-sense explain`: asks a server's ExplainTrigger what it would decide on a trigger now, and prints every check readably.
use hcp_sense_api::v1::{
    deliver_trigger_request::PayloadSource, ingest_service_client::IngestServiceClient,
    CheckVerdict, DeliverTriggerRequest, Disposition, DropReason, ExplainTriggerRequest,
    ExplainTriggerResponse,
};

use super::ServerArgs;

/// Options of `hcp-sense explain`.
#[derive(Debug, Clone, clap::Args)]
pub struct ExplainArgs {
    /// The server, and an `admin` or `runtime` role's token for it.
    #[command(flatten)]
    pub server: ServerArgs,
    /// The trigger's pack.
    #[arg(long)]
    pub pack: String,
    /// The trigger's ref.
    #[arg(long = "ref")]
    pub r#ref: String,
    /// Who the trigger is for.
    #[arg(long)]
    pub principal: String,
    /// The trigger's land (its Policy entry's, for it to be recorded).
    #[arg(long)]
    pub land: String,
    /// The payload, as a JSON object (filters read it).
    #[arg(long)]
    pub payload: Option<String>,
    #[arg(long, default_value = "")]
    pub project: String,
    /// A trigger id: one recorded before for the pack is answered with its record.
    #[arg(long, default_value = "")]
    pub trigger_id: String,
    /// Print the answer as JSON instead.
    #[arg(long)]
    pub json: bool,
}

/// Asks and prints; the answer's text, or the server's refusal as an error.
pub async fn run(a: ExplainArgs) -> anyhow::Result<String> {
    let server = a.server.connect()?;
    let mut client = IngestServiceClient::new(server.channel.clone());
    let trigger = DeliverTriggerRequest {
        pack_id: a.pack.clone(),
        r#ref: a.r#ref.clone(),
        principal: a.principal.clone(),
        land: a.land.clone(),
        payload_source: a.payload.clone().map(PayloadSource::PayloadJson),
        project: a.project.clone(),
        trigger_id: a.trigger_id.clone(),
        ..Default::default()
    };
    let answer = client
        .explain_trigger(server.request(ExplainTriggerRequest {
            trigger: Some(trigger),
        }))
        .await
        .map_err(|s| anyhow::anyhow!("{:?}: {}", s.code(), s.message()))?
        .into_inner();
    Ok(if a.json {
        json(&answer).to_string()
    } else {
        text(&answer)
    })
}

fn reason(v: i32) -> String {
    DropReason::try_from(v)
        .map(|r| {
            r.as_str_name()
                .trim_start_matches("DROP_REASON_")
                .to_ascii_lowercase()
        })
        .unwrap_or_else(|_| v.to_string())
}

fn decision(a: &ExplainTriggerResponse) -> String {
    match Disposition::try_from(a.disposition) {
        Ok(Disposition::RecordedInbox) => "recorded (inbox)".to_owned(),
        Ok(Disposition::RecordedSilent) => "recorded (silent)".to_owned(),
        Ok(Disposition::Dropped) => format!("dropped: {}", reason(a.drop_reason)),
        _ => "unknown".to_owned(),
    }
}

/// The answer as an operator reads it: the decision, then each check with its facts.
pub fn text(a: &ExplainTriggerResponse) -> String {
    let mut out = format!("decision: {}", decision(a));
    if !a.binding_id.is_empty() {
        out.push_str(&format!(" with Binding `{}`", a.binding_id));
    }
    out.push('\n');
    if !a.duplicate_record_id.is_empty() {
        out.push_str(&format!(
            "  the trigger id was recorded before as {}: DeliverTrigger answers with that record\n",
            a.duplicate_record_id
        ));
    }
    for c in &a.checks {
        let mark = match CheckVerdict::try_from(c.verdict) {
            Ok(CheckVerdict::Pass) => "pass",
            Ok(CheckVerdict::Fail) => "FAIL",
            _ => "  - ",
        };
        out.push_str(&format!("  [{mark}] {:<10} {}\n", c.name, c.detail));
        let mut facts: Vec<_> = c.facts.iter().collect();
        facts.sort();
        if !facts.is_empty() {
            let line: Vec<String> = facts.iter().map(|(k, v)| format!("{k}={v:?}")).collect();
            out.push_str(&format!("         {:<10} {}\n", "", line.join(" ")));
        }
    }
    out
}

fn json(a: &ExplainTriggerResponse) -> serde_json::Value {
    serde_json::json!({
        "decision": decision(a),
        "drop_reason": (a.drop_reason != 0).then(|| reason(a.drop_reason)),
        "binding_id": a.binding_id,
        "duplicate_record_id": a.duplicate_record_id,
        "checks": a.checks.iter().map(|c| serde_json::json!({
            "name": c.name,
            "verdict": CheckVerdict::try_from(c.verdict).map(|v| v.as_str_name().trim_start_matches("CHECK_VERDICT_").to_ascii_lowercase()).unwrap_or_default(),
            "drop_reason": reason(c.drop_reason),
            "facts": c.facts,
            "detail": c.detail,
        })).collect::<Vec<_>>(),
    })
}
