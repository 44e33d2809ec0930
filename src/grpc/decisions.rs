//! DecisionService: ListDecisions and GetDecision, the decision log read by the viewer rules of records.
use std::sync::Arc;

use tonic::{Request, Response, Status};

use super::convert::{drop_reason, drop_reason_from, time_span, timestamp};
use super::paging::{fingerprint, PageTokens};
use super::pb::{self, decision_service_server::DecisionService};
use crate::auth::Caller;
use crate::domain::decision_log::{Entry, Logged};
use crate::error::Error;
use crate::service::DecisionLog;
use crate::store::decisions::DecisionFilter;

#[derive(Clone, Debug)]
pub struct DecisionsApi {
    pub decisions: Arc<DecisionLog>,
    pub pages: PageTokens,
}

fn opt(s: String) -> Option<String> {
    (!s.is_empty()).then_some(s)
}

fn outcome(o: Logged) -> pb::DecisionOutcome {
    match o {
        Logged::Inbox => pb::DecisionOutcome::Inbox,
        Logged::Silent => pb::DecisionOutcome::Silent,
        Logged::Dropped => pb::DecisionOutcome::Dropped,
        Logged::Refused => pb::DecisionOutcome::Refused,
        Logged::Duplicate => pb::DecisionOutcome::Duplicate,
    }
}

fn outcome_from(v: i32) -> Result<Option<Logged>, Error> {
    Ok(Some(match pb::DecisionOutcome::try_from(v) {
        Ok(pb::DecisionOutcome::Unspecified) => return Ok(None),
        Ok(pb::DecisionOutcome::Inbox) => Logged::Inbox,
        Ok(pb::DecisionOutcome::Silent) => Logged::Silent,
        Ok(pb::DecisionOutcome::Dropped) => Logged::Dropped,
        Ok(pb::DecisionOutcome::Refused) => Logged::Refused,
        Ok(pb::DecisionOutcome::Duplicate) => Logged::Duplicate,
        Err(_) => return Err(Error::invalid("outcome", format!("unknown outcome {v}"))),
    }))
}

/// An entry as the API shows it.
pub fn decision(e: &Entry) -> pb::Decision {
    pb::Decision {
        decision_id: format!("{}.{}", e.decided_time, e.seq),
        decide_time: Some(timestamp(e.decided_time)),
        pack_id: e.pack_id.clone(),
        r#ref: e.r#ref.clone(),
        principal: e.principal.clone(),
        land: e.land.clone(),
        project: e.project.clone().unwrap_or_default(),
        binding_id: e.binding_id.clone(),
        trigger_id: e.trigger_id.clone().unwrap_or_default(),
        source: e.source.clone(),
        outcome: outcome(e.outcome) as i32,
        drop_reason: e
            .drop_reason
            .map_or(pb::DropReason::Unspecified, drop_reason) as i32,
        check: e.check.clone(),
        detail: e.detail.clone(),
        record_id: e.record_id.clone().unwrap_or_default(),
        trace_id: e.trace_id.clone().unwrap_or_default(),
        folded: e.folded,
    }
}

fn filter_fingerprint(f: &DecisionFilter) -> String {
    let o = |s: &Option<String>| s.clone().unwrap_or_default();
    let n = |t: Option<i64>| t.map(|t| t.to_string()).unwrap_or_default();
    fingerprint(&[
        &o(&f.viewer),
        &o(&f.principal),
        &o(&f.pack_id),
        &o(&f.r#ref),
        &o(&f.trigger_id),
        f.outcome.map_or("", Logged::as_str),
        f.drop_reason.map_or("", |r| r.as_str()),
        &o(&f.source),
        &n(f.start_time),
        &n(f.end_time),
    ])
}

#[tonic::async_trait]
impl DecisionService for DecisionsApi {
    async fn list_decisions(
        &self,
        req: Request<pb::ListDecisionsRequest>,
    ) -> Result<Response<pb::ListDecisionsResponse>, Status> {
        const KIND: &str = "decisions";
        let caller = req.extensions().get::<Caller>().cloned();
        let r = req.into_inner();
        let (start_time, end_time) = time_span(r.start_time.as_ref(), r.end_time.as_ref())?;
        let filter = DecisionFilter {
            viewer: opt(r.viewer),
            principal: opt(r.principal),
            pack_id: opt(r.pack_id),
            r#ref: opt(r.r#ref),
            trigger_id: opt(r.trigger_id),
            outcome: outcome_from(r.outcome)?,
            drop_reason: drop_reason_from("drop_reason", r.drop_reason)?,
            source: opt(r.source),
            start_time,
            end_time,
        };
        let page = self.pages.page(
            KIND,
            filter_fingerprint(&filter),
            r.page_size,
            &r.page_token,
        )?;
        let after = match page.after::<2>()? {
            None => None,
            Some([t, seq]) => {
                let bad = || Error::invalid("page_token", "is malformed");
                Some((
                    t.parse().map_err(|_| bad())?,
                    seq.parse().map_err(|_| bad())?,
                ))
            }
        };
        let mut entries = self
            .decisions
            .list(caller.as_ref(), filter, after, page.limit())
            .await?;
        let (decisions, next_page_token) = page.next(
            &mut entries,
            |e| [e.decided_time.to_string(), e.seq.to_string()],
            decision,
        );
        Ok(Response::new(pb::ListDecisionsResponse {
            decisions,
            next_page_token,
        }))
    }

    async fn get_decision(
        &self,
        req: Request<pb::GetDecisionRequest>,
    ) -> Result<Response<pb::GetDecisionResponse>, Status> {
        let caller = req.extensions().get::<Caller>().cloned();
        let r = req.into_inner();
        if r.pack_id.is_empty() {
            return Err(Error::invalid("pack_id", "is required").into());
        }
        if r.trigger_id.is_empty() {
            return Err(Error::invalid("trigger_id", "is required").into());
        }
        let filter = DecisionFilter {
            viewer: opt(r.viewer),
            pack_id: Some(r.pack_id.clone()),
            trigger_id: Some(r.trigger_id.clone()),
            ..Default::default()
        };
        let found = self
            .decisions
            .list(caller.as_ref(), filter, None, 1)
            .await?;
        let Some(e) = found.first() else {
            return Err(Error::NotFound(format!(
                "no decision of trigger_id `{}` of pack `{}` is kept for you: never decided, past --decision-retention, erased, folded into another entry, or another principal's",
                r.trigger_id, r.pack_id
            ))
            .into());
        };
        Ok(Response::new(pb::GetDecisionResponse {
            decision: Some(decision(e)),
        }))
    }
}
