//! What the pool must know of an HTTP/2 server's frames, read off the byte stream as hyper reads
//! it (after the TLS layer): the stream limit of its `SETTINGS` (`SETTINGS_MAX_CONCURRENT_STREAMS`,
//! RFC 9113 §6.5.2), and its `GOAWAY` (§6.8). Every other frame is skipped by its length. hyper
//! keeps both to itself; the pool needs them to put no more streams on a connection than the
//! server takes, and none on one it is closing.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use tokio::sync::watch;

/// Frame types and the setting read from the server.
const SETTINGS: u8 = 0x4;
const GOAWAY: u8 = 0x7;
const ACK: u8 = 0x1;
const MAX_CONCURRENT_STREAMS: u16 = 0x3;
/// The longest `SETTINGS` payload read (a server sends a handful of 6-byte entries).
const SETTINGS_READ: usize = 6 * 32;

/// What the server said, shared by the connection and its [`FrameWatch`].
#[derive(Debug)]
pub(super) struct PeerFrames {
    /// `SETTINGS_MAX_CONCURRENT_STREAMS` (unlimited until the server names it).
    max_streams: AtomicU32,
    going_away: AtomicBool,
    state: watch::Sender<PeerState>,
}

#[derive(Clone, Copy, Debug, Default)]
struct PeerState {
    /// The server's first `SETTINGS` arrived.
    settled: bool,
    /// The connection's IO is gone (closed, or failed).
    ended: bool,
}

impl PeerFrames {
    pub(super) fn new() -> Arc<Self> {
        Arc::new(Self {
            max_streams: AtomicU32::new(u32::MAX),
            going_away: AtomicBool::new(false),
            state: watch::Sender::new(PeerState::default()),
        })
    }

    /// The server's stream limit in force.
    pub(super) fn max_streams(&self) -> u32 {
        self.max_streams.load(Ordering::Acquire)
    }

    /// Whether the server sent a `GOAWAY`.
    pub(super) fn going_away(&self) -> bool {
        self.going_away.load(Ordering::Acquire)
    }

    /// Whether the connection's IO is gone.
    pub(super) fn ended(&self) -> bool {
        self.state.borrow().ended
    }

    /// Until the server's first `SETTINGS` (`true`), or the end of the connection (`false`).
    pub(super) async fn settled(&self) -> bool {
        let mut rx = self.state.subscribe();
        rx.wait_for(|s| s.settled || s.ended)
            .await
            .is_ok_and(|s| s.settled)
    }

    /// Until the connection's IO is gone.
    pub(super) async fn gone(&self) {
        let mut rx = self.state.subscribe();
        let _ = rx.wait_for(|s| s.ended).await;
    }
}

/// Follows the frames of the byte stream a server sends on an HTTP/2 connection (after the TLS
/// layer, as hyper reads it) for what the pool must know: the stream limit of its `SETTINGS`
/// and its `GOAWAY`. Everything else is skipped by its length. Dropped with the connection's
/// IO, which marks the connection ended.
#[derive(Debug)]
pub(super) struct FrameWatch {
    peer: Arc<PeerFrames>,
    head: [u8; 9],
    head_len: usize,
    /// Payload bytes of the current frame still to come.
    left: usize,
    /// The current frame is a `SETTINGS` (not an ACK): its payload is read.
    settings: bool,
    payload: Vec<u8>,
}

impl FrameWatch {
    pub(super) fn new(peer: Arc<PeerFrames>) -> Self {
        Self {
            peer,
            head: [0; 9],
            head_len: 0,
            left: 0,
            settings: false,
            payload: Vec::new(),
        }
    }

    /// Reads `bytes`, the next ones of the stream.
    pub(super) fn feed(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.head_len < self.head.len() {
                let n = (self.head.len() - self.head_len).min(bytes.len());
                self.head[self.head_len..self.head_len + n].copy_from_slice(&bytes[..n]);
                self.head_len += n;
                bytes = &bytes[n..];
                if self.head_len == self.head.len() {
                    self.begin();
                }
            } else {
                let n = self.left.min(bytes.len());
                if self.settings {
                    let room = SETTINGS_READ.saturating_sub(self.payload.len());
                    self.payload.extend_from_slice(&bytes[..n.min(room)]);
                }
                self.left -= n;
                bytes = &bytes[n..];
                if self.left == 0 {
                    self.end();
                }
            }
        }
    }

    /// A frame's head is complete.
    fn begin(&mut self) {
        let [l0, l1, l2, kind, flags, ..] = self.head;
        self.left = (usize::from(l0) << 16) | (usize::from(l1) << 8) | usize::from(l2);
        self.settings = kind == SETTINGS && flags & ACK == 0;
        self.payload.clear();
        if kind == GOAWAY {
            self.peer.going_away.store(true, Ordering::Release);
        }
        if self.left == 0 {
            self.end();
        }
    }

    /// A frame's payload is complete.
    fn end(&mut self) {
        if self.settings {
            for entry in self.payload.chunks_exact(6) {
                let id = u16::from_be_bytes([entry[0], entry[1]]);
                if id == MAX_CONCURRENT_STREAMS {
                    let value = u32::from_be_bytes([entry[2], entry[3], entry[4], entry[5]]);
                    self.peer.max_streams.store(value, Ordering::Release);
                }
            }
            self.peer
                .state
                .send_if_modified(|s| !std::mem::replace(&mut s.settled, true));
        }
        self.head_len = 0;
        self.settings = false;
    }
}

impl Drop for FrameWatch {
    fn drop(&mut self) {
        self.peer.state.send_modify(|s| s.ended = true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, flags: u8, payload: &[u8]) -> Vec<u8> {
        let len = payload.len() as u32;
        let mut f = len.to_be_bytes()[1..].to_vec();
        f.extend([kind, flags, 0, 0, 0, 0]);
        f.extend(payload);
        f
    }

    fn setting(id: u16, value: u32) -> Vec<u8> {
        let mut e = id.to_be_bytes().to_vec();
        e.extend(value.to_be_bytes());
        e
    }

    #[test]
    fn the_stream_limit_and_goaway_are_read_across_any_split_of_the_bytes() {
        let mut wire = Vec::new();
        // SETTINGS: a window size, then the stream limit.
        let mut settings = setting(0x4, 1 << 20);
        settings.extend(setting(MAX_CONCURRENT_STREAMS, 7));
        wire.extend(frame(SETTINGS, 0, &settings));
        // A SETTINGS ACK, a DATA frame whose payload looks like a SETTINGS frame, a WINDOW_UPDATE.
        wire.extend(frame(SETTINGS, ACK, &[]));
        wire.extend(frame(
            0x0,
            0,
            &frame(SETTINGS, 0, &setting(MAX_CONCURRENT_STREAMS, 1)),
        ));
        wire.extend(frame(0x8, 0, &[0, 0, 0, 1]));
        let before_goaway = wire.len();
        wire.extend(frame(GOAWAY, 0, &[0, 0, 0, 5, 0, 0, 0, 0]));
        for split in 1..wire.len() {
            let peer = PeerFrames::new();
            let mut watch = FrameWatch::new(peer.clone());
            let mut seen_goaway_at = None;
            for (i, chunk) in wire.chunks(split).enumerate() {
                watch.feed(chunk);
                if peer.going_away() && seen_goaway_at.is_none() {
                    seen_goaway_at = Some((i + 1) * split);
                }
            }
            assert_eq!(peer.max_streams(), 7, "split {split}");
            assert!(peer.state.borrow().settled);
            let at = seen_goaway_at.expect("GOAWAY seen");
            assert!(at > before_goaway, "not before its frame, split {split}");
            assert!(!peer.ended());
            drop(watch);
            assert!(peer.ended(), "the IO gone with the watch");
        }
    }

    #[test]
    fn without_the_setting_the_limit_stays_unlimited_and_a_later_settings_changes_it() {
        let peer = PeerFrames::new();
        let mut watch = FrameWatch::new(peer.clone());
        watch.feed(&frame(SETTINGS, 0, &[]));
        assert!(peer.state.borrow().settled);
        assert_eq!(peer.max_streams(), u32::MAX);
        watch.feed(&frame(SETTINGS, 0, &setting(MAX_CONCURRENT_STREAMS, 100)));
        assert_eq!(peer.max_streams(), 100);
        assert!(!peer.going_away());
    }
}
