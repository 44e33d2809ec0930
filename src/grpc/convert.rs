//! Conversions between protobuf messages and domain types, in one place.
use prost_types::{value::Kind, ListValue, Struct, Timestamp, Value as PbValue};
use serde_json::{Map, Number, Value};

use super::pb;
use crate::domain::model::{ActivationRow, Binding, DropReport, ExecuteState, Grant, Record};
use crate::domain::pack::{
    BindingMode, Finding, PackKind, RegisteredPack, Severity, TriggerSource,
};
use crate::domain::policy::{BindingState, Route};
use crate::domain::trigger::{DropReason, Outcome};
use crate::error::Error;

/// A protobuf Struct as a JSON object. Whole numbers come back as integers.
pub fn struct_to_json(s: Struct) -> Value {
    Value::Object(
        s.fields
            .into_iter()
            .map(|(k, v)| (k, value_to_json(v)))
            .collect::<Map<_, _>>(),
    )
}

/// A protobuf Struct sent by a caller as a JSON object. JSON has no NaN or Infinity: a
/// Struct holding one is refused naming `field` and the path to the number, rather than
/// stored with `null` in its place.
pub fn struct_to_json_checked(field: &str, s: Struct) -> Result<Value, Error> {
    if let Some(path) = non_finite(&s.fields) {
        return Err(Error::invalid(
            field,
            format!("holds NaN or Infinity at `{path}`; JSON numbers are finite"),
        ));
    }
    Ok(struct_to_json(s))
}

/// The path of the first NaN or infinite number in a Struct's fields. The path is written
/// only once one is found: every delivery's payload is walked, and nearly none holds one.
fn non_finite(fields: &std::collections::BTreeMap<String, PbValue>) -> Option<String> {
    fields
        .iter()
        .find_map(|(k, v)| value_non_finite(v).map(|rest| format!("{k}{rest}")))
}

/// Where in `v` the first NaN or infinite number is, as the rest of a path (empty: `v`
/// itself).
fn value_non_finite(v: &PbValue) -> Option<String> {
    match &v.kind {
        Some(Kind::NumberValue(n)) if !n.is_finite() => Some(String::new()),
        Some(Kind::StructValue(s)) => s
            .fields
            .iter()
            .find_map(|(k, v)| value_non_finite(v).map(|rest| format!(".{k}{rest}"))),
        Some(Kind::ListValue(l)) => l
            .values
            .iter()
            .enumerate()
            .find_map(|(i, v)| value_non_finite(v).map(|rest| format!("[{i}]{rest}"))),
        _ => None,
    }
}

fn value_to_json(v: PbValue) -> Value {
    match v.kind {
        None | Some(Kind::NullValue(_)) => Value::Null,
        Some(Kind::BoolValue(b)) => Value::Bool(b),
        Some(Kind::NumberValue(n)) => {
            if n.fract() == 0.0 && n.abs() < 9.0e15 {
                // Safe: |n| < 2^53, so the cast is exact.
                #[allow(clippy::cast_possible_truncation)]
                Value::Number(Number::from(n as i64))
            } else {
                Number::from_f64(n).map_or(Value::Null, Value::Number)
            }
        }
        Some(Kind::StringValue(s)) => Value::String(s),
        Some(Kind::ListValue(l)) => Value::Array(l.values.into_iter().map(value_to_json).collect()),
        Some(Kind::StructValue(s)) => struct_to_json(s),
    }
}

/// A JSON object as a protobuf Struct; other JSON values give an empty Struct.
pub fn json_to_struct(v: &Value) -> Struct {
    match v {
        Value::Object(m) => Struct {
            fields: m
                .iter()
                .map(|(k, v)| (k.clone(), json_to_value(v)))
                .collect(),
        },
        _ => Struct::default(),
    }
}

fn json_to_value(v: &Value) -> PbValue {
    let kind = match v {
        Value::Null => Kind::NullValue(0),
        Value::Bool(b) => Kind::BoolValue(*b),
        Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(0.0)),
        Value::String(s) => Kind::StringValue(s.clone()),
        Value::Array(a) => Kind::ListValue(ListValue {
            values: a.iter().map(json_to_value).collect(),
        }),
        Value::Object(_) => Kind::StructValue(json_to_struct(v)),
    };
    PbValue { kind: Some(kind) }
}

pub fn timestamp(micros: i64) -> Timestamp {
    Timestamp {
        seconds: micros.div_euclid(1_000_000),
        // In 0..1_000_000_000, so it fits.
        #[allow(clippy::cast_possible_truncation)]
        nanos: (micros.rem_euclid(1_000_000) * 1000) as i32,
    }
}

pub fn finding(f: &Finding) -> pb::LintFinding {
    pb::LintFinding {
        severity: match f.severity {
            Severity::Error => pb::Severity::Error,
            Severity::Warning => pb::Severity::Warning,
        } as i32,
        rule: f.rule.to_owned(),
        field: f.field.clone(),
        message: f.message.clone(),
    }
}

fn kind(k: PackKind) -> pb::PackKind {
    match k {
        PackKind::Standard => pb::PackKind::Standard,
        PackKind::SenseOnly => pb::PackKind::SenseOnly,
    }
}

pub fn binding_mode(m: BindingMode) -> pb::BindingMode {
    match m {
        BindingMode::User => pb::BindingMode::User,
        BindingMode::Local => pb::BindingMode::Local,
        BindingMode::Mothership => pb::BindingMode::Mothership,
        BindingMode::Public => pb::BindingMode::Public,
    }
}

pub fn trigger_source(s: TriggerSource) -> pb::TriggerSource {
    match s {
        TriggerSource::Push => pb::TriggerSource::Push,
        TriggerSource::Poll => pb::TriggerSource::Poll,
        TriggerSource::Timer => pb::TriggerSource::Timer,
        TriggerSource::Monitor => pb::TriggerSource::Monitor,
    }
}

pub fn pack(p: &RegisteredPack) -> pb::Pack {
    let m = &p.manifest;
    pb::Pack {
        pack_id: m.pack_id.clone(),
        kind: kind(m.kind) as i32,
        binding_mode: binding_mode(m.binding_mode) as i32,
        binding_hub: m.binding_hub.clone().unwrap_or_default(),
        stimulus_triggers: m
            .triggers
            .iter()
            .map(|t| pb::StimulusTrigger {
                r#ref: t.r#ref.clone(),
                source: trigger_source(t.source) as i32,
            })
            .collect(),
        stimuli: m
            .stimuli
            .iter()
            .map(|s| pb::PolicyStimulus {
                r#ref: s.r#ref.clone(),
                operation: s.operation.clone(),
                land: s.land.clone(),
            })
            .collect(),
        commands: m
            .commands
            .iter()
            .map(|c| pb::PackCommand {
                name: c.name.clone(),
                installs_webhook: c.installs_webhook,
            })
            .collect(),
        upstream_requires_registration: m.upstream_requires_registration,
        manifest: Some(json_to_struct(&m.raw)),
        create_time: Some(timestamp(p.create_time)),
        update_time: Some(timestamp(p.update_time)),
        generation: p.generation,
    }
}

pub fn route(r: Route) -> pb::Route {
    match r {
        Route::Inbox => pb::Route::Inbox,
        Route::Silent => pb::Route::Silent,
    }
}

/// A route from the wire; `None` for ROUTE_UNSPECIFIED.
pub fn route_from(field: &'static str, v: i32) -> Result<Option<Route>, Error> {
    match pb::Route::try_from(v) {
        Ok(pb::Route::Unspecified) => Ok(None),
        Ok(pb::Route::Inbox) => Ok(Some(Route::Inbox)),
        Ok(pb::Route::Silent) => Ok(Some(Route::Silent)),
        Err(_) => Err(Error::invalid(field, format!("unknown route {v}"))),
    }
}

pub fn binding_state(s: BindingState) -> pb::BindingState {
    match s {
        BindingState::Linked => pb::BindingState::Linked,
        BindingState::Stale => pb::BindingState::Stale,
        BindingState::NeedsReauth => pb::BindingState::NeedsReauth,
        BindingState::Pending => pb::BindingState::Pending,
        BindingState::Error => pb::BindingState::Error,
    }
}

/// A Binding state from the wire; `None` for BINDING_STATE_UNSPECIFIED.
pub fn binding_state_from(field: &'static str, v: i32) -> Result<Option<BindingState>, Error> {
    Ok(Some(match pb::BindingState::try_from(v) {
        Ok(pb::BindingState::Unspecified) => return Ok(None),
        Ok(pb::BindingState::Linked) => BindingState::Linked,
        Ok(pb::BindingState::Stale) => BindingState::Stale,
        Ok(pb::BindingState::NeedsReauth) => BindingState::NeedsReauth,
        Ok(pb::BindingState::Pending) => BindingState::Pending,
        Ok(pb::BindingState::Error) => BindingState::Error,
        Err(_) => return Err(Error::invalid(field, format!("unknown binding state {v}"))),
    }))
}

pub fn drop_reason(r: DropReason) -> pb::DropReason {
    match r {
        DropReason::UnknownPack => pb::DropReason::UnknownPack,
        DropReason::UndeclaredRef => pb::DropReason::UndeclaredRef,
        DropReason::NoGrant => pb::DropReason::NoGrant,
        DropReason::NoConnectedBinding => pb::DropReason::NoConnectedBinding,
        DropReason::LandMismatch => pb::DropReason::LandMismatch,
        DropReason::ActivationOff => pb::DropReason::ActivationOff,
        DropReason::NoProject => pb::DropReason::NoProject,
        DropReason::Filtered => pb::DropReason::Filtered,
        DropReason::FilterError => pb::DropReason::FilterError,
    }
}

pub fn drop_reason_from(field: &'static str, v: i32) -> Result<Option<DropReason>, Error> {
    Ok(Some(match pb::DropReason::try_from(v) {
        Ok(pb::DropReason::Unspecified) => return Ok(None),
        Ok(pb::DropReason::UnknownPack) => DropReason::UnknownPack,
        Ok(pb::DropReason::UndeclaredRef) => DropReason::UndeclaredRef,
        Ok(pb::DropReason::NoGrant) => DropReason::NoGrant,
        Ok(pb::DropReason::NoConnectedBinding) => DropReason::NoConnectedBinding,
        Ok(pb::DropReason::LandMismatch) => DropReason::LandMismatch,
        Ok(pb::DropReason::ActivationOff) => DropReason::ActivationOff,
        Ok(pb::DropReason::NoProject) => DropReason::NoProject,
        Ok(pb::DropReason::Filtered) => DropReason::Filtered,
        Ok(pb::DropReason::FilterError) => DropReason::FilterError,
        Err(_) => return Err(Error::invalid(field, format!("unknown drop reason {v}"))),
    }))
}

pub fn trigger_source_from(v: i32) -> Option<Result<TriggerSource, i32>> {
    match pb::TriggerSource::try_from(v) {
        Ok(pb::TriggerSource::Unspecified) => None,
        Ok(pb::TriggerSource::Push) => Some(Ok(TriggerSource::Push)),
        Ok(pb::TriggerSource::Poll) => Some(Ok(TriggerSource::Poll)),
        Ok(pb::TriggerSource::Timer) => Some(Ok(TriggerSource::Timer)),
        Ok(pb::TriggerSource::Monitor) => Some(Ok(TriggerSource::Monitor)),
        Err(_) => Some(Err(v)),
    }
}

pub fn outcome(o: &Outcome) -> pb::TriggerOutcome {
    pb::TriggerOutcome {
        disposition: disposition(o) as i32,
        drop_reason: o
            .drop_reason
            .map_or(pb::DropReason::Unspecified, drop_reason) as i32,
        record_id: o.record_id.clone().unwrap_or_default(),
        duplicate: o.duplicate,
    }
}

pub fn disposition(o: &Outcome) -> pb::Disposition {
    match o.route {
        Some(Route::Inbox) => pb::Disposition::RecordedInbox,
        Some(Route::Silent) => pb::Disposition::RecordedSilent,
        None => pb::Disposition::Dropped,
    }
}

pub fn quota(q: &crate::domain::quota::Quota) -> pb::Quota {
    pb::Quota {
        pack_id: q.pack_id.clone(),
        principal: q.principal.clone(),
        rate_per_second: q.rule.rate,
        burst: q.rule.burst,
        update_time: Some(timestamp(q.update_time)),
    }
}

/// A wait as a protobuf Duration.
pub fn duration(d: std::time::Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        // Below 1e9, so it fits.
        #[allow(clippy::cast_possible_wrap)]
        nanos: d.subsec_nanos() as i32,
    }
}

pub fn grant(g: &Grant) -> pb::Grant {
    pb::Grant {
        principal: g.principal.clone(),
        pack_id: g.pack_id.clone(),
        create_time: Some(timestamp(g.create_time)),
    }
}

pub fn binding(b: &Binding) -> pb::Binding {
    pb::Binding {
        principal: b.principal.clone(),
        pack_id: b.pack_id.clone(),
        binding_id: b.binding_id.clone(),
        mode: binding_mode(b.mode) as i32,
        state: binding_state(b.state) as i32,
        update_time: Some(timestamp(b.update_time)),
    }
}

/// An activation as DeactivateSense, ActivateSense and ListActivations answer it: a disabled
/// one routes nothing, so it has no route (ROUTE_UNSPECIFIED), as GetPackState says of it.
pub fn activation(a: &ActivationRow) -> pb::SenseActivation {
    pb::SenseActivation {
        principal: a.principal.clone(),
        pack_id: a.pack_id.clone(),
        enabled: a.enabled,
        route: match a.enabled {
            true => route(a.route),
            false => pb::Route::Unspecified,
        } as i32,
        update_time: Some(timestamp(a.update_time)),
        filter: a.filter.clone(),
    }
}

pub fn execute_state(e: &ExecuteState) -> pb::ExecuteState {
    pb::ExecuteState {
        principal: e.principal.clone(),
        pack_id: e.pack_id.clone(),
        installed: e.installed,
        activated: e.activated,
        connected: e.connected,
        update_time: (e.update_time != 0).then(|| timestamp(e.update_time)),
    }
}

pub fn record(r: &Record) -> pb::Record {
    pb::Record {
        record_id: r.record_id.clone(),
        principal: r.principal.clone(),
        binding_id: r.binding_id.clone(),
        land: r.land.clone(),
        pack_id: r.pack_id.clone(),
        r#ref: r.r#ref.clone(),
        payload: Some(Struct {
            fields: r
                .payload
                .iter()
                .map(|(k, v)| (k.clone(), json_to_value(v)))
                .collect(),
        }),
        route: route(r.route) as i32,
        project: r.project.clone().unwrap_or_default(),
        trigger_id: r.trigger_id.clone().unwrap_or_default(),
        receive_time: Some(timestamp(r.received_time)),
    }
}

pub fn drop_report(d: &DropReport) -> pb::DropReport {
    pb::DropReport {
        pack_id: d.pack_id.clone(),
        r#ref: d.r#ref.clone(),
        reason: drop_reason(d.reason) as i32,
        count: d.count,
        first_seen_time: Some(timestamp(d.first_seen)),
        last_seen_time: Some(timestamp(d.last_seen)),
    }
}

/// A listing's `start_time` and `end_time`, each in microseconds since the epoch when given.
pub fn time_span(
    start: Option<&Timestamp>,
    end: Option<&Timestamp>,
) -> Result<(Option<i64>, Option<i64>), Error> {
    Ok((
        start.map(|t| micros("start_time", t)).transpose()?,
        end.map(|t| micros("end_time", t)).transpose()?,
    ))
}

/// Microseconds since the epoch of a wire timestamp.
pub fn micros(field: &'static str, t: &Timestamp) -> Result<i64, Error> {
    if !(0..1_000_000_000).contains(&t.nanos) {
        return Err(Error::invalid(field, "nanos must be in 0..1e9"));
    }
    t.seconds
        .checked_mul(1_000_000)
        .and_then(|s| s.checked_add(i64::from(t.nanos / 1000)))
        .ok_or_else(|| Error::invalid(field, "is out of range"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn number(n: f64) -> PbValue {
        PbValue {
            kind: Some(Kind::NumberValue(n)),
        }
    }

    /// The path names the first non-finite number wherever it sits; finite payloads have none.
    #[test]
    fn a_non_finite_number_is_named_by_its_path() {
        let mut s = json_to_struct(&serde_json::json!({
            "a": 1, "b": { "c": [1, { "d": 2 }] }, "e": "x"
        }));
        assert_eq!(non_finite(&s.fields), None);
        assert!(struct_to_json_checked("payload", s.clone()).is_ok());
        s.fields.insert("e".into(), number(f64::NAN));
        assert_eq!(non_finite(&s.fields).as_deref(), Some("e"));
        if let Some(Kind::StructValue(b)) = s.fields.get_mut("b").and_then(|v| v.kind.as_mut()) {
            if let Some(Kind::ListValue(l)) = b.fields.get_mut("c").and_then(|v| v.kind.as_mut()) {
                if let Some(Kind::StructValue(d)) = l.values[1].kind.as_mut() {
                    d.fields.insert("d".into(), number(f64::INFINITY));
                }
            }
        }
        // Fields are walked in key order: `b` before `e`.
        assert_eq!(non_finite(&s.fields).as_deref(), Some("b.c[1].d"));
        let e = struct_to_json_checked("payload", s).expect_err("refused");
        assert!(e.to_string().contains("`b.c[1].d`"), "{e}");
    }
}
