//! The Python clients under tests/python (the official SDKs users run), given a JSON plan on standard input and answering one JSON document.
use std::io::Write;
use std::process::{Command, Stdio};

/// Runs `tests/python/{script}` with `plan` on standard input; answers what it printed, as
/// JSON. `needs` names the Python packages it imports, for the failure message.
pub async fn run(
    script: &'static str,
    needs: &'static str,
    plan: serde_json::Value,
) -> serde_json::Value {
    let out = tokio::task::spawn_blocking(move || {
        let mut child = Command::new("python3")
            .arg(format!("tests/python/{script}"))
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("python3 with {needs} (see .ci/test): {e}"));
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(plan.to_string().as_bytes())
            .expect("plan");
        child.wait_with_output().expect(script)
    })
    .await
    .expect("join");
    assert!(
        out.status.success(),
        "{script} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{script} answered no JSON: {e}: {} / {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}
