//! A TCP proxy that can freeze, as a partition or a vanished database host does.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::helpers::TestDb;
use crate::support::served::Served;

/// A TCP proxy that can freeze: while frozen it forwards nothing and closes nothing, as a
/// network partition or a vanished database host does.
pub struct FreezingProxy {
    addr: String,
    frozen: Arc<AtomicBool>,
    /// Connections opened before this epoch are frozen for good (a failover: the old host is
    /// gone without a word, new connections reach the new one).
    epoch: Arc<std::sync::atomic::AtomicU64>,
}

impl FreezingProxy {
    pub async fn start(upstream: String) -> FreezingProxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let frozen = Arc::new(AtomicBool::new(false));
        let epoch = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let (f, e) = (frozen.clone(), epoch.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (f, e, upstream) = (f.clone(), e.clone(), upstream.clone());
                tokio::spawn(async move {
                    let born = e.load(Ordering::SeqCst);
                    let gate = Gate {
                        frozen: f,
                        epoch: e,
                        born,
                    };
                    gate.open().await;
                    let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                        return;
                    };
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::spawn(pump(cr, sw, gate.clone()));
                    pump(sr, cw, gate).await;
                });
            }
        });
        FreezingProxy {
            addr,
            frozen,
            epoch,
        }
    }

    /// A server whose database (postgres://user@HOST:PORT/name) is reached through a proxy.
    pub async fn serve(db: &TestDb, extra: &[&str]) -> (FreezingProxy, Served) {
        let (head, rest) = db.url.split_once('@').expect("url with user");
        let (host_port, tail) = rest.split_once('/').expect("url with database");
        let proxy = FreezingProxy::start(host_port.to_owned()).await;
        let served = Served::start(&format!("{head}@{}/{tail}", proxy.addr), extra);
        (proxy, served)
    }

    pub fn freeze(&self, on: bool) {
        self.frozen.store(on, Ordering::SeqCst);
    }

    /// Every connection open now goes silent for good; new ones flow.
    pub fn fail_over(&self) {
        self.epoch.fetch_add(1, Ordering::SeqCst);
    }
}

/// Whether one proxied connection may pass bytes.
#[derive(Clone)]
pub struct Gate {
    frozen: Arc<AtomicBool>,
    epoch: Arc<std::sync::atomic::AtomicU64>,
    born: u64,
}

impl Gate {
    pub async fn open(&self) {
        while self.frozen.load(Ordering::SeqCst) || self.epoch.load(Ordering::SeqCst) > self.born {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

pub async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    gate: Gate,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        gate.open().await;
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
