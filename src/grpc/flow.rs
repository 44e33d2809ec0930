//! HTTP/2 flow control of the gRPC listener: stream and connection windows chosen together with h2's budget for buffered DATA frames, so a producer that stays inside the windows is slowed by them, never sent GOAWAY.
//!
//! h2 (0.4.20) charges every DATA frame of fewer than 256 payload bytes that it holds unread
//! `256 - len` against a per-connection budget, and sends `GOAWAY ENHANCE_YOUR_CALM
//! too_many_data_frames` when the budget is spent; a frame read by the service pays back its
//! charge. hyper does not expose the budget: it is half the connection window. With hyper's
//! defaults (1 MiB windows, a 512 KiB budget) a producer sending one small trigger per frame,
//! as grpcio does, spends the budget long before the window: 43-byte triggers (48-byte
//! frames, 208 each) spend it after about 2,500 unread frames, while the window admits 21,000.
//!
//! So the windows are set the other way round. What a connection holds unread is bounded by
//! its streams' windows, `max_concurrent_streams × STREAM_WINDOW`, plus the 65,535 bytes a
//! client may send before it has read the server's SETTINGS; the connection window is made
//! large enough that this much, sent in the smallest frames a valid trigger comes in, is still
//! inside the budget. The connection window then never binds, and the per-stream window is
//! what holds a producer back.
//!
//! The budget is also what bounds the memory a connection can hold in unread frames (each
//! costs h2 about 256 bytes beside its data): at the default 256 streams it is about 53 MB, a
//! bound per connection that --max-connections-per-peer multiplies. Frames smaller than a
//! valid trigger's (no gRPC client sends them but to attack) can still spend it: h2's GOAWAY
//! is then the defence it was made for.

use crate::config::MAX_CONCURRENT_STREAMS;

/// Bytes a stream may send before the server has read them: what one stream can hold unread.
pub const STREAM_WINDOW: u32 = 16 << 10;

/// The smallest DATA frame a valid trigger comes in: the 5-byte gRPC prefix and the shortest
/// valid DeliverTriggersRequest (pack, ref, principal and land of one letter each).
pub const SMALLEST_MESSAGE_FRAME: u64 = 19;

/// What a client may send before it has read the server's SETTINGS: HTTP/2's initial
/// connection window, however its streams share it.
const BEFORE_SETTINGS: u64 = 65_535;

/// h2's threshold: a DATA frame shorter than this is charged `THRESHOLD - len` while unread.
const FRAME_OVERHEAD_THRESHOLD: u64 = 256;

/// The largest window HTTP/2 allows (RFC 9113 §6.9.1).
const MAX_WINDOW: u64 = (1 << 31) - 1;

/// The windows of the gRPC listener for `max_concurrent_streams`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Windows {
    pub stream: u32,
    pub connection: u32,
}

impl Windows {
    /// The stream window is STREAM_WINDOW, smaller when so many streams are allowed that the
    /// largest connection window could not cover them; the connection window is twice (h2's
    /// budget is half of it) the charge of every stream's window, and what may come before
    /// SETTINGS, filled with the smallest frames.
    pub fn for_streams(max_concurrent_streams: u32) -> Windows {
        let streams = u64::from(max_concurrent_streams.clamp(1, MAX_CONCURRENT_STREAMS));
        let charge = FRAME_OVERHEAD_THRESHOLD - SMALLEST_MESSAGE_FRAME;
        let window = |unread: u64| 2 * (unread + BEFORE_SETTINGS) * charge / SMALLEST_MESSAGE_FRAME;
        let mut stream = u64::from(STREAM_WINDOW);
        if window(streams * stream) > MAX_WINDOW {
            // Solve window(streams × stream) ≤ MAX_WINDOW for stream.
            stream = ((MAX_WINDOW * SMALLEST_MESSAGE_FRAME / (2 * charge))
                .saturating_sub(BEFORE_SETTINGS)
                / streams)
                .max(1);
        }
        // HTTP/2 starts every window at 65,535: a smaller one is never set.
        let connection = window(streams * stream).clamp(65_535, MAX_WINDOW);
        Windows {
            stream: u32::try_from(stream).unwrap_or(STREAM_WINDOW),
            connection: u32::try_from(connection).unwrap_or(u32::MAX >> 1),
        }
    }

    /// The most DATA-frame charge h2 allows on one connection before GOAWAY.
    pub fn frame_budget(&self) -> u64 {
        u64::from(self.connection) / 2
    }

    /// The charge of `streams` windows, and what may come before SETTINGS, filled with frames
    /// of `frame_len` bytes.
    pub fn charge_when_full(&self, streams: u32, frame_len: u64) -> u64 {
        let unread = u64::from(streams) * u64::from(self.stream) + BEFORE_SETTINGS;
        let frames = unread / frame_len.max(1);
        frames * FRAME_OVERHEAD_THRESHOLD.saturating_sub(frame_len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_stream_full_of_the_smallest_frames_stays_inside_the_budget() {
        for streams in [1, 8, 100, 256, 1024, MAX_CONCURRENT_STREAMS] {
            let w = Windows::for_streams(streams);
            for frame in [SMALLEST_MESSAGE_FRAME, 48, 171, 255] {
                assert!(
                    w.charge_when_full(streams, frame) <= w.frame_budget(),
                    "{streams} streams of {frame}-byte frames: {w:?}"
                );
            }
            assert!(u64::from(w.connection) <= MAX_WINDOW);
            assert!(w.stream >= 1 && w.stream <= STREAM_WINDOW);
        }
        // The default: 256 streams of 16 KiB each, 4 MiB unread at most per connection.
        let w = Windows::for_streams(256);
        assert_eq!(w.stream, STREAM_WINDOW);
        assert_eq!(
            u64::from(w.connection),
            2 * (256 * (16 << 10) + 65_535) * 237 / 19
        );
        // Tight: the default leaves less than two of the smallest frames' charge spare, and
        // what that budget lets a connection hold in unread frames is about 53 MB.
        let spare = w.frame_budget() - w.charge_when_full(256, SMALLEST_MESSAGE_FRAME);
        assert!(spare < 2 * 237, "{spare}");
        assert!(w.frame_budget() < 54_000_000, "{}", w.frame_budget());
    }

    #[test]
    fn the_smallest_frame_is_the_shortest_valid_trigger() {
        use crate::grpc::pb::{DeliverTriggerRequest, DeliverTriggersRequest};
        use prost::Message as _;
        let shortest = DeliverTriggersRequest {
            trigger: Some(DeliverTriggerRequest {
                pack_id: "a".into(),
                r#ref: "a".into(),
                principal: "a".into(),
                land: "a".into(),
                ..Default::default()
            }),
        };
        use crate::domain::names::{check_land, check_pack_id, check_ref};
        assert!(check_pack_id("a").is_ok() && check_ref("a").is_ok() && check_land("a").is_ok());
        assert!(check_pack_id("").is_err() && check_ref("").is_err() && check_land("").is_err());
        assert_eq!(5 + shortest.encoded_len() as u64, SMALLEST_MESSAGE_FRAME);
    }

    #[test]
    fn hypers_defaults_would_send_goaway_to_a_small_frame_producer() {
        // What a producer of 43-byte triggers met before: a 1 MiB stream and connection window.
        let hyper = Windows {
            stream: 1 << 20,
            connection: 1 << 20,
        };
        assert!(hyper.charge_when_full(1, 48) > hyper.frame_budget());
    }
}
