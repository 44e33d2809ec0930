//! A pack's trigger types: each declared ref's description and compiled payload schema, compiled once per pack version.
use std::collections::HashMap;
use std::sync::Arc;

use serde_json::Value;

use super::{binding_degraded_schema, declared, PayloadSchema};
use crate::domain::pack::BINDING_DEGRADED;

/// The hub's schema of `binding.degraded`, compiled once for every pack that declares it.
fn hub_schema() -> Option<Arc<PayloadSchema>> {
    static HUB: std::sync::LazyLock<Option<Arc<PayloadSchema>>> = std::sync::LazyLock::new(|| {
        PayloadSchema::compile(&binding_degraded_schema())
            .ok()
            .map(Arc::new)
    });
    HUB.clone()
}

/// What a pack declares of one ref beyond its name.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TriggerType {
    pub description: Option<String>,
    pub schema: Option<Arc<PayloadSchema>>,
}

/// A pack's declared refs with their descriptions and compiled schemas: compiled once per
/// pack version and shared by every decision on it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TriggerTypes {
    types: HashMap<String, TriggerType>,
}

impl TriggerTypes {
    /// The trigger types of a manifest's `stimulusTriggers`. A schema that does not compile (one
    /// registered before a bound was added) leaves its ref unchecked; lint refuses it on the
    /// next registration. `binding.degraded` always has the hub's schema.
    pub fn of_manifest(raw: &Value) -> TriggerTypes {
        let types = declared(raw)
            .map(|(r, description, schema)| {
                let schema = if r == BINDING_DEGRADED {
                    hub_schema()
                } else {
                    schema.and_then(|s| PayloadSchema::compile(s).ok().map(Arc::new))
                };
                let description = description.map(str::to_owned);
                (
                    r.to_owned(),
                    TriggerType {
                        description,
                        schema,
                    },
                )
            })
            .collect();
        TriggerTypes { types }
    }

    /// The declared refs, in no order.
    pub fn refs(&self) -> impl Iterator<Item = &str> {
        self.types.keys().map(String::as_str)
    }

    /// The payload schema of `ref`, if it has one.
    pub fn schema(&self, r#ref: &str) -> Option<&PayloadSchema> {
        self.get(r#ref).and_then(|t| t.schema.as_deref())
    }

    /// The payload schema of `ref`, shared, if it has one.
    pub fn schema_arc(&self, r#ref: &str) -> Option<Arc<PayloadSchema>> {
        self.get(r#ref).and_then(|t| t.schema.clone())
    }

    pub fn get(&self, r#ref: &str) -> Option<&TriggerType> {
        self.types.get(r#ref)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn s7_7_2_binding_degraded_has_the_hubs_schema_whatever_the_pack_says() {
        let manifest = json!({"stimulusTriggers": [{"ref": "binding.degraded",
            "payloadSchema": {"type": "object", "properties": {"state": {"type": "integer"}}}}]});
        let c = TriggerTypes::of_manifest(&manifest);
        let hub = c.schema(BINDING_DEGRADED).expect("schema");
        assert_eq!(hub.raw, binding_degraded_schema());
        assert!(hub.check(&json!({"state": "stale"})).is_empty());
        assert_eq!(hub.check(&json!({"state": 3}))[0].pointer, "/state");
        assert_eq!(hub.check(&json!({}))[0].keyword, "required");
    }
}
