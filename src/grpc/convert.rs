//! Conversions between protobuf messages and domain types, in one place.
use prost_types::{value::Kind, ListValue, Struct, Timestamp, Value as PbValue};
use serde_json::{Map, Number, Value};

use super::pb;
use crate::domain::pack::{
    BindingMode, Finding, PackKind, RegisteredPack, Severity, TriggerSource,
};

/// A protobuf Struct as a JSON object. Whole numbers come back as integers.
pub fn struct_to_json(s: Struct) -> Value {
    Value::Object(
        s.fields
            .into_iter()
            .map(|(k, v)| (k, value_to_json(v)))
            .collect::<Map<_, _>>(),
    )
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
