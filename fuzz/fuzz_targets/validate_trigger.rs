//! Trigger validation never panics, and what it accepts is well-formed.
#![no_main]
use hcp_sense::domain::decide::{validate, RawTrigger};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let mut parts = text.split('\u{0}');
    let mut next = || parts.next().unwrap_or_default().to_owned();
    let (pack_id, r#ref, principal, land, payload, project, trigger_id) =
        (next(), next(), next(), next(), next(), next(), next());
    let raw = RawTrigger {
        pack_id,
        r#ref,
        principal,
        land,
        payload: serde_json::from_str(&payload).ok(),
        project,
        trigger_id,
        source: None,
    };
    if let Ok(t) = validate(raw, 64 * 1024, 32) {
        assert!(hcp_sense::domain::names::check_ref(&t.r#ref).is_ok());
        assert!(!t.principal.is_empty() && !t.principal.chars().any(char::is_control));
        assert!(t.land != "brain" || t.project.is_some());
    }
});
