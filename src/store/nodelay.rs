//! TCP_NODELAY on this process's PostgreSQL sockets, which sqlx opens without it.
//!
//! With Nagle's algorithm on, a message written while an earlier one is unacknowledged waits
//! for PostgreSQL's delayed ACK (40 ms on Linux) before it is sent: a transaction's BEGIN,
//! INSERT and COMMIT then stall on one another, and a writer that commits several batches a
//! millisecond falls to a few dozen a second. sqlx gives no hook to reach its socket, so after
//! each new connection the process's TCP sockets to the database's port get the option,
//! through a duplicate of each descriptor taken with pidfd_getfd (an option set on a duplicate
//! is set on the socket). Where the kernel refuses that (before Linux 5.6, or a seccomp policy
//! without it) nothing changes and the reason is logged once.
use rustix::process::{getpid, pidfd_getfd, pidfd_open, PidfdFlags, PidfdGetfdFlags};
use std::sync::Once;

/// Sets TCP_NODELAY on every TCP socket of this process whose peer port is `port`.
pub fn set_on_sockets_to(port: u16) {
    static REFUSED: Once = Once::new();
    let refused = |e: &dyn std::fmt::Display| {
        let e = e.to_string();
        REFUSED.call_once(|| {
            tracing::warn!(error = %e, "TCP_NODELAY could not be set on PostgreSQL sockets; commits may wait on delayed ACKs")
        });
    };
    let me = match pidfd_open(getpid(), PidfdFlags::empty()) {
        Ok(fd) => fd,
        Err(e) => return refused(&e),
    };
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return;
    };
    for entry in dir.flatten() {
        let Some(fd) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let is_socket = std::fs::read_link(entry.path())
            .map(|l| l.to_string_lossy().starts_with("socket:"))
            .unwrap_or(false);
        if !is_socket {
            continue;
        }
        // If the number was closed and taken again meanwhile, the duplicate is of whatever
        // took it, and only a TCP socket to the database's port is changed.
        let fd = match pidfd_getfd(&me, fd, PidfdGetfdFlags::empty()) {
            Ok(fd) => fd,
            Err(e) if e == rustix::io::Errno::PERM || e == rustix::io::Errno::NOSYS => {
                return refused(&e)
            }
            Err(_) => continue,
        };
        let sock = socket2::SockRef::from(&fd);
        let to_db = sock
            .peer_addr()
            .ok()
            .and_then(|a| a.as_socket())
            .is_some_and(|a| a.port() == port);
        if to_db && sock.tcp_nodelay().is_ok_and(|on| !on) {
            let _ = sock.set_tcp_nodelay(true);
        }
    }
}
