//! A TCP proxy that delays every chunk bound for PostgreSQL, as a network between server and database would.
use std::time::Duration;

/// A TCP proxy on an ephemeral port that holds every chunk bound for the database `delay`
/// before passing it on (tokio's timer rounds up to its 1 ms tick), without limiting
/// throughput; answers pass straight back. Returns its address.
pub async fn delay_proxy(upstream: String, delay: Duration) -> anyhow::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?.to_string();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let upstream = upstream.clone();
            tokio::spawn(async move {
                let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                    return;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                tokio::spawn(delay_pipe(cr, sw, delay));
                tokio::spawn(delay_pipe(sr, cw, Duration::ZERO));
            });
        }
    });
    Ok(addr)
}

async fn delay_pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    one_way: Duration,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
    tokio::spawn(async move {
        while let Some((due, bytes)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            if to.write_all(&bytes).await.is_err() {
                break;
            }
        }
    });
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if tx
                    .send((tokio::time::Instant::now() + one_way, buf[..n].to_vec()))
                    .is_err()
                {
                    break;
                }
            }
        }
    }
}
