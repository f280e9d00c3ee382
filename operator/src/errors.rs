//! Errors as text: an error with its whole `source()` chain, for logs, and the shorter form for
//! people (Event notes, status messages).

/// An error with its whole `source()` chain, for logs and status messages.
pub fn report(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// Like [`report`], for people: a Kubernetes API error ends the chain with the apiserver's
/// message and reason only (kube's own text repeats the message, then dumps the whole Status).
pub fn brief_report(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts = Vec::new();
    let mut cur = Some(e);
    while let Some(c) = cur {
        if let Some(kube::Error::Api(status)) = c.downcast_ref::<kube::Error>() {
            parts.push(status.to_string());
            break;
        }
        parts.push(c.to_string());
        cur = c.source();
    }
    parts.join(": ")
}
