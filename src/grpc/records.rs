//! RecordService: ListRecords and ListDropReports with keyset pagination, and WatchRecords continuing a listing as records commit.
use std::pin::Pin;

use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};

use super::convert::{drop_reason_from, drop_report, micros, record, route_from};
use super::paging::{fingerprint, next_token, page_size, PageTokens, SEP};
use super::pb::{self, record_service_server::RecordService};
use crate::auth::{Caller, Role};
use crate::domain::model::{Position, RecordFilter};
use crate::error::Error;
use crate::service::{Service, WatchEvent};

/// Positions, not receive times: a token of a release that paged by time is refused as not
/// issued here, and this release's tokens are refused by such a release. ListRecords' page
/// tokens and WatchRecords' resume tokens are one kind: either continues the other.
const RECORDS: &str = "records@position";

/// A reader reads as its own principal: the authenticated identity replaces `viewer`, and
/// other principals' records are not its to read. Returns the reader's principal.
fn as_reader(
    caller: Option<&Caller>,
    principal: &mut String,
    viewer: &mut String,
) -> Result<Option<String>, Error> {
    let Some(Caller::Known(id)) = caller else {
        return Ok(None);
    };
    if id.role != Role::Reader {
        return Ok(None);
    }
    let own = id.principal.clone().unwrap_or_default();
    if !principal.is_empty() && *principal != own {
        return Err(Error::PermissionDenied(format!(
            "a reader reads only its own principal's records, not `{principal}`"
        )));
    }
    *principal = own.clone();
    *viewer = own.clone();
    Ok(Some(own))
}

impl Records {
    fn position_token(&self, fp: &str, p: Position) -> String {
        self.pages
            .encode(RECORDS, fp, &format!("{}{SEP}{}", p.txid, p.seq))
    }

    /// The position a page or resume token holds (`None`: empty, the start), reported as
    /// `field` when it is not one.
    fn token_position(
        &self,
        fp: &str,
        token: &str,
        field: &str,
    ) -> Result<Option<Position>, Error> {
        let rename = |e: Error| match e {
            Error::InvalidArgument(mut v) => {
                for x in &mut v {
                    x.field = field.to_owned();
                }
                Error::InvalidArgument(v)
            }
            e => e,
        };
        let Some(k) = self.pages.decode(RECORDS, fp, token).map_err(rename)? else {
            return Ok(None);
        };
        let bad = || Error::invalid(field, "is malformed");
        let (txid, seq) = k.split_once(SEP).ok_or_else(bad)?;
        Ok(Some(Position {
            txid: txid.parse().map_err(|_| bad())?,
            seq: seq.parse().map_err(|_| bad())?,
        }))
    }
}

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
        let caller = req.extensions().get::<Caller>().cloned();
        let mut r = req.into_inner();
        as_reader(caller.as_ref(), &mut r.principal, &mut r.viewer)?;
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
        let after = self.token_position(&fp, &r.page_token, "page_token")?;
        let listed = self
            .service
            .list_records(&filter, after.as_ref(), size + 1)
            .await?;
        let mut records = listed.records;
        let token = |p: Position| self.position_token(&fp, p);
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

    type WatchRecordsStream =
        Pin<Box<dyn Stream<Item = Result<pb::WatchRecordsResponse, Status>> + Send + 'static>>;

    async fn watch_records(
        &self,
        req: Request<pb::WatchRecordsRequest>,
    ) -> Result<Response<Self::WatchRecordsStream>, Status> {
        use pb::watch_records_request::Start;
        let caller = req.extensions().get::<Caller>().cloned();
        let mut r = req.into_inner();
        let reader = as_reader(caller.as_ref(), &mut r.principal, &mut r.viewer)?;
        let filter = RecordFilter {
            viewer: opt(r.viewer),
            principal: opt(r.principal),
            pack_id: opt(r.pack_id),
            r#ref: opt(r.r#ref),
            land: opt(r.land),
            route: route_from("route", r.route)?,
            ..RecordFilter::default()
        };
        // The filters first, then the slot: a refused watch holds none.
        let watch = self.service.open_watch(&filter)?;
        let fp = filter_fingerprint(&filter);
        let from = match r.start {
            Some(Start::ResumeToken(t)) if !t.is_empty() => self
                .token_position(&fp, &t, "resume_token")?
                .unwrap_or_default(),
            Some(Start::AfterRecordId(id)) => {
                self.service.position_of(&id, reader.as_deref()).await?
            }
            Some(Start::FromNow(true)) => self.service.now_position().await?,
            _ => {
                return Err(Error::invalid(
                    "start",
                    "set one of resume_token (a ListRecords or WatchRecords token), after_record_id, or from_now: true",
                )
                .into())
            }
        };
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        tokio::spawn(watch.run(filter, from, tx));
        let this = self.clone();
        let stream =
            tokio_stream::wrappers::ReceiverStream::new(rx).map(move |event| match event {
                WatchEvent::Sent { records, position } => Ok(pb::WatchRecordsResponse {
                    // The last look before the records go out: none erased since they were read.
                    records: records
                        .iter()
                        .filter(|r| !this.service.erased(r))
                        .map(|r| record(r))
                        .collect(),
                    resume_token: this.position_token(&fp, position),
                }),
                WatchEvent::Ended {
                    cause,
                    why,
                    position,
                } => Err(Status::from(Error::Interrupted {
                    cause,
                    message: why,
                    resume_token: this.position_token(&fp, position),
                })),
            });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn erase_records(
        &self,
        req: Request<pb::EraseRecordsRequest>,
    ) -> Result<Response<pb::EraseRecordsResponse>, Status> {
        let actor = super::actor_of(&req);
        let r = req.into_inner();
        let svc = self.service.clone();
        // Run to the end even if the caller goes: each batch commits on its own.
        let erased = crate::service::detached(async move {
            svc.erase_records(&actor, &r.principal, &r.pack_id).await
        })
        .await?;
        Ok(Response::new(pb::EraseRecordsResponse {
            erased_count: i64::try_from(erased).unwrap_or(i64::MAX),
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
