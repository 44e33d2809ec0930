//! The ListRecords phase: pages read at the first and at a deep keyset position, and the paging helpers the scale phase shares.
use std::time::Instant;

use tonic::transport::Channel;

use crate::load::Phase;
use crate::report::{header, row};
use crate::seed::{now_micros, BenchDb};
use crate::server::Server;
use crate::{bin, pb, seed, server, Options};

/// Pages through an unfiltered listing `pages` pages of `size` deep; returns the token there.
pub async fn page_down(ch: &Channel, size: i32, pages: usize) -> anyhow::Result<String> {
    let mut client = pb::record_service_client::RecordServiceClient::new(ch.clone());
    let mut token = String::new();
    for _ in 0..pages {
        let r = client
            .list_records(pb::ListRecordsRequest {
                page_size: size,
                page_token: token.clone(),
                ..Default::default()
            })
            .await?
            .into_inner();
        if r.next_page_token.is_empty() {
            break;
        }
        token = r.next_page_token;
    }
    Ok(token)
}

/// 300 ListRecords calls for a page of 100 from `token`, one after another; a call that errs
/// or returns a short page counts as an error.
pub async fn list_page_latency(ch: &Channel, token: &str) -> Phase {
    let mut client = pb::record_service_client::RecordServiceClient::new(ch.clone());
    let mut lat = Vec::new();
    let start = Instant::now();
    let mut errors = 0;
    for _ in 0..300 {
        let t = Instant::now();
        match client
            .list_records(pb::ListRecordsRequest {
                page_size: 100,
                page_token: token.to_owned(),
                ..Default::default()
            })
            .await
        {
            Ok(r) if r.get_ref().records.len() == 100 => lat.push(t.elapsed().as_micros() as u64),
            _ => errors += 1,
        }
    }
    lat.sort_unstable();
    Phase {
        calls: lat.len(),
        errors,
        secs: start.elapsed().as_secs_f64(),
        lat_us: lat,
    }
}

/// ListRecords' first page and a page deep into the listing, reached by paging.
pub async fn list_records(o: &Options) -> anyhow::Result<()> {
    println!("ListRecords: a page of 100 from {} records", o.list_records);
    let pop = o.population(o.principals);
    for kind in &o.stores {
        let db = BenchDb::create(kind, &o.postgres_url, "list").await?;
        server::migrate(bin(o), &db.url)?;
        let conn = db.connect().await?;
        let t0 = Instant::now();
        seed::records_bulk(&conn, pop, o.list_records, now_micros() - 3_600_000_000).await?;
        let _ = conn.close().await;
        println!(
            "{kind:<9} seeded {} records through the bulk path in {:.1} s",
            o.list_records,
            t0.elapsed().as_secs_f64()
        );
        let server = Server::start(bin(o), &db.url, &[])?;
        let chs = server.channels(1).await?;
        let t0 = Instant::now();
        // 90% of the way down, 1,000 records a page.
        let deep = page_down(&chs[0], 1000, o.list_records * 9 / 10 / 1000).await?;
        println!(
            "{kind:<9} paged {} records down in {:.1} s",
            o.list_records * 9 / 10,
            t0.elapsed().as_secs_f64()
        );
        header();
        for (name, token) in [("first page", String::new()), ("deep page", deep)] {
            let p = list_page_latency(&chs[0], &token).await;
            row(kind, &format!("ListRecords {name}"), &p, None);
        }
        server.stop();
        db.drop_db().await;
    }
    println!();
    Ok(())
}
