//! What the NATS server refused on the shared connection of `nats:` targets: the permission
//! violations it answers a publish or a subscription with (`-ERR 'Permissions Violation for
//! Publish to "S"'`).
//!
//! The server answers nothing to a core publish it takes, and a refused one only with that
//! `-ERR`, which async-nats hands to the connection's event callback and to nothing else: not
//! to the publish, not to its flush. A JetStream request the server refuses is answered the
//! same way, and its caller waits for an answer that never comes. So the callback records each
//! refusal here with a sequence number, and an attempt notes the sequence before it publishes
//! and looks for a refusal of its subject after it (`Refusals::refused_publish`). The server
//! handles one connection's messages in order and async-nats passes server errors to the
//! callback in order, which is what makes "after" meaningful.

use std::collections::VecDeque;
use std::sync::Mutex;

use tokio::sync::watch;

/// How many refusals are kept. An attempt looks only at those made while it waited for its
/// round trip (milliseconds): that many refusals in that time would take a flood of failing
/// publishes, and one lost from this window fails the attempt as unconfirmed, never as
/// delivered (`Refusals::lost_since`).
const KEPT: usize = 4096;

/// The subject prefix of the client's inboxes (async-nats' default, which the router keeps):
/// the answers of JetStream requests and of the round trip that confirms a core publish come
/// to a subscription under it.
pub const INBOX_PREFIX: &str = "_INBOX.";

/// One refusal of the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// A publish to this subject was refused (and dropped).
    Publish(String),
    /// A subscription to this subject was refused.
    Subscribe(String),
}

impl Refusal {
    /// The refusal a server error's text reports, if it is one. nats-server writes the
    /// subject with Go's `%q` (quoted, `"` and `\` escaped); a subscription with a queue group
    /// adds ` using queue "Q"`.
    pub fn parse(text: &str) -> Option<Self> {
        let unquote = |q: &str| -> Option<String> {
            let inner = q.strip_prefix('"')?;
            let mut out = String::with_capacity(inner.len());
            let mut chars = inner.chars();
            while let Some(c) = chars.next() {
                match c {
                    '\\' => out.push(chars.next()?),
                    '"' => return Some(out),
                    c => out.push(c),
                }
            }
            None
        };
        if let Some(rest) = text.strip_prefix("Permissions Violation for Publish to ") {
            return unquote(rest).map(Self::Publish);
        }
        if let Some(rest) = text.strip_prefix("Permissions Violation for Subscription to ") {
            return unquote(rest).map(Self::Subscribe);
        }
        None
    }
}

/// What `Refusals` holds under its lock.
#[derive(Debug, Default)]
struct Log {
    /// The last `KEPT` refusals with their sequence numbers, oldest first.
    recent: VecDeque<(u64, Refusal)>,
    /// The inbox subscription the server refused since the client last (re)connected: no
    /// answer to any request of the client can arrive until a reconnect subscribes again.
    inbox_refused: Option<String>,
}

/// The refusals of one connection.
#[derive(Debug)]
pub struct Refusals {
    log: Mutex<Log>,
    /// The sequence number of the last refusal; waiters watch it.
    seq: watch::Sender<u64>,
}

impl Default for Refusals {
    fn default() -> Self {
        Self {
            log: Mutex::default(),
            seq: watch::Sender::new(0),
        }
    }
}

/// Where an attempt started looking, from `Refusals::watch`.
pub struct Watch {
    /// Refusals after this sequence number are the attempt's concern.
    pub since: u64,
    /// Changes when a refusal is recorded.
    pub changed: watch::Receiver<u64>,
}

impl Refusals {
    fn log(&self) -> std::sync::MutexGuard<'_, Log> {
        self.log.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records a refusal (from the event callback).
    pub fn record(&self, refusal: Refusal) {
        let mut log = self.log();
        if let Refusal::Subscribe(s) = &refusal
            && s.starts_with(INBOX_PREFIX)
        {
            log.inbox_refused = Some(s.clone());
        }
        // Numbered under the lock so that the log and the sequence agree.
        let seq = *self.seq.borrow() + 1;
        log.recent.push_back((seq, refusal));
        if log.recent.len() > KEPT {
            log.recent.pop_front();
        }
        self.seq.send_replace(seq);
    }

    /// The client (re)connected and subscribes its inbox again: a refused inbox subscription
    /// is known again only if the server refuses it again.
    pub fn connected(&self) {
        self.log().inbox_refused = None;
    }

    /// Where an attempt starts looking: taken before it publishes.
    pub fn watch(&self) -> Watch {
        let mut changed = self.seq.subscribe();
        let since = *changed.borrow_and_update();
        Watch { since, changed }
    }

    /// Whether the server refused a publish to `subject` after `since`.
    pub fn refused_publish(&self, since: u64, subject: &str) -> bool {
        self.log()
            .recent
            .iter()
            .rev()
            .take_while(|(seq, _)| *seq > since)
            .any(|(_, r)| matches!(r, Refusal::Publish(s) if s == subject))
    }

    /// Whether refusals made after `since` may have been dropped from the log (more than it
    /// keeps came in since).
    pub fn lost_since(&self, since: u64) -> bool {
        self.log()
            .recent
            .front()
            .is_some_and(|(oldest, _)| *oldest > since + 1)
    }

    /// The inbox subscription the server refused, while that holds.
    pub fn inbox_refused(&self) -> Option<String> {
        self.log().inbox_refused.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_servers_permission_errors_are_parsed() {
        assert_eq!(
            Refusal::parse(r#"Permissions Violation for Publish to "orders.paid""#),
            Some(Refusal::Publish("orders.paid".into()))
        );
        assert_eq!(
            Refusal::parse(r#"Permissions Violation for Publish to "a\"b\\c""#),
            Some(Refusal::Publish(r#"a"b\c"#.into()))
        );
        assert_eq!(
            Refusal::parse(r#"Permissions Violation for Subscription to "_INBOX.x.*""#),
            Some(Refusal::Subscribe("_INBOX.x.*".into()))
        );
        assert_eq!(
            Refusal::parse(r#"Permissions Violation for Subscription to "a.b" using queue "q""#),
            Some(Refusal::Subscribe("a.b".into()))
        );
        assert_eq!(
            Refusal::parse("Permissions Violation for Publish to a"),
            None
        );
        assert_eq!(
            Refusal::parse(r#"Permissions Violation for Publish to "a"#),
            None
        );
        assert_eq!(Refusal::parse("Stale Connection"), None);
    }

    #[test]
    fn only_refusals_after_the_mark_count() {
        let r = Refusals::default();
        r.record(Refusal::Publish("a".into()));
        let w = r.watch();
        assert!(!r.refused_publish(w.since, "a"), "before the mark");
        r.record(Refusal::Publish("b".into()));
        assert!(r.refused_publish(w.since, "b"));
        assert!(!r.refused_publish(w.since, "a"));
        assert!(w.changed.has_changed().unwrap_or(false));
        r.record(Refusal::Publish("a".into()));
        assert!(r.refused_publish(w.since, "a"));
        assert!(!r.lost_since(w.since));
        for _ in 0..KEPT {
            r.record(Refusal::Publish("c".into()));
        }
        assert!(r.lost_since(w.since));
    }

    #[test]
    fn a_refused_inbox_holds_until_the_next_connect() {
        let r = Refusals::default();
        r.record(Refusal::Subscribe("orders.>".into()));
        assert_eq!(r.inbox_refused(), None);
        r.record(Refusal::Subscribe("_INBOX.abc.*".into()));
        assert_eq!(r.inbox_refused().as_deref(), Some("_INBOX.abc.*"));
        r.connected();
        assert_eq!(r.inbox_refused(), None);
    }
}
