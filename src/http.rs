//! The HTTP listeners' sockets (ingress, metrics): at most a fixed number open at once, each closed once it carries no bytes for IDLE.
//!
//! The ingress listener faces webhook senders, often the internet: a client that opens
//! sockets and never sends (or never finishes) a request, or leaves keep-alive connections
//! idle, must not hold file descriptors and memory for ever.
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};

/// Most sockets open at once on one HTTP listener; further clients wait in the backlog.
pub const MAX_CONNECTIONS: usize = 1024;

/// A TCP listener whose sockets are capped in number and closed when idle.
pub struct Guarded {
    listener: TcpListener,
    slots: Arc<Semaphore>,
    idle: Duration,
}

impl Guarded {
    pub fn new(listener: TcpListener, max_connections: usize, idle: Duration) -> Guarded {
        Guarded {
            listener,
            slots: Arc::new(Semaphore::new(max_connections.max(1))),
            idle,
        }
    }
}

impl axum::serve::Listener for Guarded {
    type Io = IdleIo;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (IdleIo, SocketAddr) {
        loop {
            // The semaphore is never closed.
            let Ok(slot) = self.slots.clone().acquire_owned().await else {
                continue;
            };
            match self.listener.accept().await {
                Ok((stream, addr)) => {
                    let _ = stream.set_nodelay(true);
                    return (IdleIo::new(stream, slot, self.idle), addr);
                }
                Err(e) => {
                    // Out of file descriptors, say: wait rather than spin.
                    tracing::warn!(error = %e, "HTTP accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }
}

/// A socket that fails (and so is closed) after `idle` without a byte read or written.
pub struct IdleIo {
    stream: TcpStream,
    _slot: OwnedSemaphorePermit,
    idle: Duration,
    deadline: Pin<Box<Sleep>>,
}

impl IdleIo {
    fn new(stream: TcpStream, slot: OwnedSemaphorePermit, idle: Duration) -> IdleIo {
        IdleIo {
            stream,
            _slot: slot,
            idle,
            deadline: Box::pin(tokio::time::sleep(idle)),
        }
    }

    fn progressed(&mut self) {
        let next = Instant::now() + self.idle;
        self.deadline.as_mut().reset(next);
    }

    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        self.deadline.as_mut().poll(cx).is_ready()
    }
}

fn idle_error() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "connection idle")
}

impl AsyncRead for IdleIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.stream).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    self.progressed();
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending if self.expired(cx) => Poll::Ready(Err(idle_error())),
            other => other,
        }
    }
}

impl AsyncWrite for IdleIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match Pin::new(&mut self.stream).poll_write(cx, buf) {
            Poll::Ready(Ok(n)) => {
                if n > 0 {
                    self.progressed();
                }
                Poll::Ready(Ok(n))
            }
            Poll::Pending if self.expired(cx) => Poll::Ready(Err(idle_error())),
            other => other,
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}
