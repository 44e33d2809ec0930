//! RecordService: ListRecords and ListDropReports with keyset pagination.
use tonic::{Request, Response, Status};

use super::convert::{drop_reason_from, drop_report, micros, record, route_from};
use super::paging::{fingerprint, next_token, page_size, PageTokens, SEP};
use super::pb::{self, record_service_server::RecordService};
use crate::auth::{Caller, Role};
use crate::domain::model::{Position, RecordFilter};
use crate::error::Error;
use crate::service::Service;

#[derive(Clone, Debug)]
pub struct Records {
    pub service: Service,
    pub pages: PageTokens,
}

fn opt(s: String) -> Option<String> {
    (!s.is_empty()).then_some(s)
}

fn bad_token(rule: &str) -> Error {
    Error::invalid("page_token", rule)
}

/// The fingerprint of a ListRecords listing: its filters and order.
fn filter_fingerprint(f: &RecordFilter) -> String {
    let opt = |s: &Option<String>| s.clone().unwrap_or_default();
    let num = |n: Option<i64>| n.map(|n| n.to_string()).unwrap_or_default();
    fingerprint(&[
        &opt(&f.viewer),
        &opt(&f.principal),
        &opt(&f.pack_id),
        &opt(&f.r#ref),
        &opt(&f.land),
        f.route.map_or("", |r| r.as_str()),
        &num(f.start_time),
        &num(f.end_time),
        if f.descending { "desc" } else { "asc" },
    ])
}

#[tonic::async_trait]
impl RecordService for Records {
    async fn list_records(
        &self,
        req: Request<pb::ListRecordsRequest>,
    ) -> Result<Response<pb::ListRecordsResponse>, Status> {
        // Positions, not receive times: a token of a release that paged by time is refused as
        // not issued here, and this release's tokens are refused by such a release.
        const KIND: &str = "records@position";
        let caller = req.extensions().get::<Caller>().cloned();
        let mut r = req.into_inner();
        // A reader reads as its own principal: the authenticated identity
        // replaces `viewer`, and other principals' records are not its to list.
        if let Some(Caller::Known(id)) = &caller {
            if id.role == Role::Reader {
                let own = id.principal.clone().unwrap_or_default();
                if !r.principal.is_empty() && r.principal != own {
                    return Err(Error::PermissionDenied(format!(
                        "a reader lists only its own principal's records, not `{}`",
                        r.principal
                    ))
                    .into());
                }
                r.principal = own.clone();
                r.viewer = own;
            }
        }
        let descending = match r.order_by.trim().to_ascii_lowercase().as_str() {
            "" | "receive_time" | "receive_time asc" => false,
            "receive_time desc" => true,
            other => {
                return Err(Error::invalid(
                    "order_by",
                    format!("`{other}` is not one of `receive_time asc`, `receive_time desc`"),
                )
                .into())
            }
        };
        let filter = RecordFilter {
            viewer: opt(r.viewer),
            principal: opt(r.principal),
            pack_id: opt(r.pack_id),
            r#ref: opt(r.r#ref),
            land: opt(r.land),
            route: route_from("route", r.route)?,
            start_time: r
                .start_time
                .as_ref()
                .map(|t| micros("start_time", t))
                .transpose()?,
            end_time: r
                .end_time
                .as_ref()
                .map(|t| micros("end_time", t))
                .transpose()?,
            descending,
        };
        let fp = filter_fingerprint(&filter);
        let size = page_size(r.page_size)?;
        let after = match self.pages.decode(KIND, &fp, &r.page_token)? {
            None => None,
            Some(k) => {
                let Some((txid, seq)) = k.split_once(SEP) else {
                    return Err(bad_token("is malformed").into());
                };
                Some(Position {
                    txid: txid.parse().map_err(|_| bad_token("is malformed"))?,
                    seq: seq.parse().map_err(|_| bad_token("is malformed"))?,
                })
            }
        };
        let listed = self
            .service
            .list_records(&filter, after.as_ref(), size + 1)
            .await?;
        let mut records = listed.records;
        let token = |p: Position| {
            self.pages
                .encode(KIND, &fp, &format!("{}{SEP}{}", p.txid, p.seq))
        };
        let mut next_page_token = next_token(&mut records, size, |r| token(r.position));
        // Writes still in flight may commit after this page: an ascending listing goes on
        // from here (an empty page is possible) rather than end. Descending, they would come
        // before its first page, as any later write does.
        let end = token(
            records
                .last()
                .map(|r| r.position)
                .or(after)
                .unwrap_or_default(),
        );
        if next_page_token.is_empty() && !listed.settled && !filter.descending {
            next_page_token = end.clone();
        }
        let resume_page_token = match (filter.descending, next_page_token.is_empty()) {
            (true, _) => String::new(),
            (false, false) => next_page_token.clone(),
            (false, true) => end,
        };
        Ok(Response::new(pb::ListRecordsResponse {
            records: records.iter().map(record).collect(),
            next_page_token,
            resume_page_token,
        }))
    }

    async fn list_drop_reports(
        &self,
        req: Request<pb::ListDropReportsRequest>,
    ) -> Result<Response<pb::ListDropReportsResponse>, Status> {
        const KIND: &str = "drop_reports";
        let r = req.into_inner();
        let size = page_size(r.page_size)?;
        let reason = drop_reason_from("reason", r.reason)?;
        let fp = fingerprint(&[&r.pack_id, &r.reason.to_string()]);
        let token = self.pages.decode(KIND, &fp, &r.page_token)?;
        let after = match &token {
            None => None,
            Some(k) => {
                let mut parts = k.splitn(3, SEP);
                match (parts.next(), parts.next(), parts.next()) {
                    (Some(p), Some(rf), Some(why)) => Some((p, rf, why)),
                    _ => return Err(bad_token("is malformed").into()),
                }
            }
        };
        let pack = (!r.pack_id.is_empty()).then_some(r.pack_id.as_str());
        let mut reports = self
            .service
            .list_drop_reports(pack, reason, after, size + 1)
            .await?;
        let next_page_token = next_token(&mut reports, size, |d| {
            self.pages.encode(
                KIND,
                &fp,
                &format!("{}{SEP}{}{SEP}{}", d.pack_id, d.r#ref, d.reason.as_str()),
            )
        });
        Ok(Response::new(pb::ListDropReportsResponse {
            drop_reports: reports.iter().map(drop_report).collect(),
            next_page_token,
        }))
    }
}
