//! RecordService: ListRecords and ListDropReports with keyset pagination, and WatchRecords continuing a listing as records commit.
use std::pin::Pin;

use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};

use super::convert::{drop_reason_from, drop_report, record, route_from, time_span};
use super::paging::{fingerprint, next_token, page_size, PageTokens};
use super::pb::{self, record_service_server::RecordService};
use crate::auth::Caller;
use crate::domain::model::{Position, RecordFilter};
use crate::error::Error;
use crate::service::{read_as, WatchEvent};

#[derive(Clone, Debug)]
pub struct RecordsApi {
    pub records: crate::service::Records,
    pub pages: PageTokens,
}

fn opt(s: String) -> Option<String> {
    (!s.is_empty()).then_some(s)
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
impl RecordService for RecordsApi {
    async fn list_records(
        &self,
        req: Request<pb::ListRecordsRequest>,
    ) -> Result<Response<pb::ListRecordsResponse>, Status> {
        let caller = req.extensions().get::<Caller>().cloned();
        let mut r = req.into_inner();
        read_as(caller.as_ref(), &mut r.principal, &mut r.viewer)?;
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
        let (start_time, end_time) = time_span(r.start_time.as_ref(), r.end_time.as_ref())?;
        let filter = RecordFilter {
            viewer: opt(r.viewer),
            principal: opt(r.principal),
            pack_id: opt(r.pack_id),
            r#ref: opt(r.r#ref),
            land: opt(r.land),
            route: route_from("route", r.route)?,
            record_id: None,
            start_time,
            end_time,
            descending,
        };
        let fp = filter_fingerprint(&filter);
        let size = page_size(r.page_size)?;
        let after = self
            .pages
            .token_position(&fp, &r.page_token, "page_token")?;
        let listed = self
            .records
            .list_records(&filter, after.as_ref(), size + 1)
            .await?;
        let mut records = listed.records;
        let token = |p: Position| self.pages.position_token(&fp, p);
        let (page, mut next_page_token) =
            next_token(&mut records, size, |r| token(r.position), record);
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
            records: page,
            next_page_token,
            resume_page_token,
        }))
    }

    async fn get_record(
        &self,
        req: Request<pb::GetRecordRequest>,
    ) -> Result<Response<pb::GetRecordResponse>, Status> {
        let caller = req.extensions().get::<Caller>().cloned();
        let mut r = req.into_inner();
        let mut principal = String::new();
        read_as(caller.as_ref(), &mut principal, &mut r.viewer)?;
        crate::service::valid_id("record_id", &r.record_id)?;
        let filter = RecordFilter {
            viewer: opt(r.viewer),
            principal: opt(principal),
            record_id: Some(r.record_id.clone()),
            ..RecordFilter::default()
        };
        let found = self.records.list_records(&filter, None, 1).await?;
        match found.records.into_iter().next() {
            Some(found) => Ok(Response::new(pb::GetRecordResponse {
                record: Some(record(&found)),
            })),
            None => Err(Error::NotFound(format!("record `{}` not found", r.record_id)).into()),
        }
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
        let reader = read_as(caller.as_ref(), &mut r.principal, &mut r.viewer)?;
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
        let watch = self.records.open_watch(&filter)?;
        let fp = filter_fingerprint(&filter);
        let from = match r.start {
            Some(Start::ResumeToken(t)) if !t.is_empty() => self
                .pages
                .token_position(&fp, &t, "resume_token")?
                .unwrap_or_default(),
            Some(Start::AfterRecordId(id)) => {
                self.records.position_of(&id, reader.as_deref()).await?
            }
            Some(Start::FromNow(true)) => self.records.now_position().await?,
            _ => {
                return Err(Error::invalid(
                    "start",
                    "set one of resume_token (a ListRecords or WatchRecords token), after_record_id, or from_now: true",
                )
                .into())
            }
        };
        let pages = self.pages.clone();
        let stream = watch.start(filter, from).map(move |event| match event {
            WatchEvent::Sent { records, position } => Ok(pb::WatchRecordsResponse {
                records: records.iter().map(|r| record(r)).collect(),
                resume_token: pages.position_token(&fp, position),
            }),
            WatchEvent::Ended {
                cause,
                why,
                position,
            } => Err(Status::from(Error::Interrupted {
                cause,
                message: why,
                resume_token: pages.position_token(&fp, position),
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
        let svc = self.records.clone();
        // Run to the end even if the caller goes: each batch commits on its own.
        let erased = crate::service::detached(self.records.lifecycle(), async move {
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
        let reason = drop_reason_from("reason", r.reason)?;
        let page = self.pages.page(
            KIND,
            fingerprint(&[&r.pack_id, &r.reason.to_string()]),
            r.page_size,
            &r.page_token,
        )?;
        let after = page.after::<3>()?.map(|[p, rf, why]| (p, rf, why));
        let pack = (!r.pack_id.is_empty()).then_some(r.pack_id.as_str());
        let mut reports = self
            .records
            .list_drop_reports(pack, reason, after, page.limit())
            .await?;
        let (drop_reports, next_page_token) = page.next(
            &mut reports,
            |d| {
                [
                    d.pack_id.clone(),
                    d.r#ref.clone(),
                    d.reason.as_str().to_owned(),
                ]
            },
            drop_report,
        );
        Ok(Response::new(pb::ListDropReportsResponse {
            drop_reports,
            next_page_token,
        }))
    }
}
