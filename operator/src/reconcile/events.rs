//! The Events the reconciler publishes about a policy it cannot read or a generation it
//! ignores, and the note every Event carries, cut to what the apiserver accepts.

use kube::runtime::events::{Event, EventType};

/// The Warning Event of a policy this operator cannot read: `error` is why.
pub fn unreadable_event(error: &str) -> Event {
    Event {
        type_: EventType::Warning,
        reason: "InvalidPolicy".into(),
        note: Some(event_note(&format!(
            "this operator cannot read the policy, so it is skipped: {error} (a field or value of a newer CRD than this operator's?)"
        ))),
        action: "Read".into(),
        secondary: None,
    }
}

/// The Warning Event of a generation too large to be real; `note` says where it was read.
pub fn implausible_generation_event(note: &str) -> Event {
    Event {
        type_: EventType::Warning,
        reason: "ImplausibleGeneration".into(),
        note: Some(event_note(note)),
        action: "Plan".into(),
        secondary: None,
    }
}

/// The longest Event note in bytes (the apiserver refuses more than 1 kB).
const MAX_NOTE_BYTES: usize = 1000;

/// `text` cut to fit an Event note, on a character boundary, marked with `…` when cut.
pub fn event_note(text: &str) -> String {
    if text.len() <= MAX_NOTE_BYTES {
        return text.to_owned();
    }
    let mut end = MAX_NOTE_BYTES - '…'.len_utf8();
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}
