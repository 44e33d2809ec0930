//! Manifest parsing (JSON or YAML text) and lint never panic, and lint is consistent with itself.
#![no_main]
use hcp_sense::domain::pack::{lint, parse_manifest_text};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(value) = parse_manifest_text(text) {
        let report = lint(&value);
        // A manifest comes back exactly when there is no error.
        assert_eq!(report.manifest.is_some(), report.is_valid());
        if let Some(m) = &report.manifest {
            for t in &m.triggers {
                assert!(hcp_sense::domain::names::check_ref(&t.r#ref).is_ok());
            }
        }
    }
});
