//! The schema phase: the cost of a typical payload schema, the check alone in this process and A/B on one server (`filter::ab_phase`).
use std::time::{Duration, Instant};

use serde_json::json;

use crate::load::Load;
use crate::report::result;
use crate::{filter, load, pb, seed, Options};

/// The cost of a payload schema on one server: recorded phases with the packs' `issue.opened`
/// declared without and with a typical schema (registered again before each), alternately.
pub async fn schema_phase(o: &Options) -> anyhow::Result<()> {
    let schema = seed::typical_schema();
    // The check alone, in this process: the benchmark triggers' payload against the schema,
    // with the validator and the options the server's payload schemas use (docs/manifest.md).
    let options = jsonschema::options()
        .with_draft(jsonschema::Draft::Draft202012)
        .with_pattern_options(jsonschema::PatternOptions::regex())
        .should_validate_formats(true);
    // The formats the server leaves as annotations (docs/manifest.md).
    let annotated = [
        "regex",
        "uri-template",
        "iri",
        "iri-reference",
        "idn-email",
        "idn-hostname",
    ];
    let compiled = annotated
        .into_iter()
        .fold(options, |o, f| o.with_format(f, |_: &str| true))
        .build(&schema)
        .map_err(|e| anyhow::anyhow!("the typical schema: {e}"))?;
    let payload = match load::trigger(7, o.population(o.principals), Load::Recorded).payload_source
    {
        Some(pb::deliver_trigger_request::PayloadSource::Payload(s)) => load::json_of_struct(s),
        _ => anyhow::bail!("the benchmark trigger has a payload"),
    };
    anyhow::ensure!(compiled.is_valid(&payload), "the payload keeps the schema");
    const N: u32 = 200_000;
    let started = Instant::now();
    let mut failing = 0;
    for _ in 0..N {
        failing += usize::from(!compiled.is_valid(std::hint::black_box(&payload)));
    }
    let check_us = started.elapsed().as_secs_f64() * 1e6 / f64::from(N);
    // Cold: each check after the caches were filled with something else, as a check between
    // other work meets its validator. The payload is read just before, as the server has just
    // decoded it when it checks it; an empty schema's check, timed the same way, is the floor
    // any check pays (the call, the clock).
    let empty = jsonschema::options()
        .with_draft(jsonschema::Draft::Draft202012)
        .build(&json!({}))
        .map_err(|e| anyhow::anyhow!("the empty schema: {e}"))?;
    const COLD: u32 = 2_000;
    let mut other = vec![0u8; 32 << 20];
    let (mut cold, mut floor) = (Duration::ZERO, Duration::ZERO);
    for n in 0..COLD {
        for (v, took) in [(&compiled, &mut cold), (&empty, &mut floor)] {
            for b in other.iter_mut().step_by(64) {
                *b = b.wrapping_add(n as u8);
            }
            std::hint::black_box(serde_json::to_vec(&payload)?);
            let at = Instant::now();
            failing += usize::from(!v.is_valid(std::hint::black_box(&payload)));
            *took += at.elapsed();
        }
    }
    std::hint::black_box(&other);
    let per = |d: Duration| d.as_secs_f64() * 1e6 / f64::from(COLD);
    let (cold_us, floor_us) = (per(cold), per(floor));
    println!("schema: one check of the benchmark payload against the typical schema {check_us:.3} us warm ({N} checks in this process), {cold_us:.3} us cold and an empty schema's {floor_us:.3} us cold ({COLD} checks each, each after 32 MiB written and the payload read); {failing} failing");
    result(
        json!({ "phase": "schema check", "check_us": check_us, "cold_check_us": cold_us, "cold_empty_check_us": floor_us, "checks": N }),
    );
    filter::ab_phase(o, "schema", ("no schema", "schema"), move |chs, pop, on| {
        let (ch, schema) = (chs[0].clone(), schema.clone());
        async move { seed::packs_with(&ch, pop, on.then_some(&schema)).await }
    })
    .await
}
