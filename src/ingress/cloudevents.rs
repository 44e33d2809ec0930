//! CloudEvents 1.0 over HTTP: an event read from a request in structured or binary mode.
use std::collections::BTreeMap;

use crate::domain::ingress::EventNames;
use serde_json::Value;

/// A CloudEvent read from an HTTP request: its context attributes (required and extensions,
/// as text) and its data.
#[derive(Debug, Clone, PartialEq)]
pub struct CloudEvent {
    pub attributes: BTreeMap<String, String>,
    pub data: Value,
    /// Structured mode: the attributes came in the body. In binary mode they came in `ce-`
    /// headers, which a signature over the body does not cover.
    pub structured: bool,
}

impl CloudEvent {
    pub fn attr(&self, name: &str) -> &str {
        self.attributes.get(name).map_or("", String::as_str)
    }

    /// The trigger id an event gives: its `source` and `id`, which together identify it.
    fn trigger_id(&self) -> String {
        format!("{}#{}", self.attr("source"), self.attr("id"))
    }

    /// What the event names itself: its type, subject and trigger id.
    pub fn names(&self) -> EventNames<'_> {
        EventNames {
            r#type: self.attr("type"),
            subject: self.attr("subject"),
            trigger_id: self.trigger_id(),
        }
    }
}

/// Reads a CloudEvents 1.0 HTTP request: structured mode when the content type is
/// `application/cloudevents+json`, else binary mode (attributes in `ce-` headers, the body
/// the data). The data must be a JSON object (it becomes the trigger's payload). A missing or
/// bad attribute is a (field, description).
pub fn cloud_event(
    headers: &BTreeMap<String, String>,
    body: &[u8],
) -> Result<CloudEvent, (String, String)> {
    let bad = |f: &str, d: &str| (f.to_owned(), d.to_owned());
    let structured = headers.get("content-type").is_some_and(|c| {
        c.trim_start()
            .to_ascii_lowercase()
            .starts_with("application/cloudevents+json")
    });
    let (attributes, data) = if structured {
        let Ok(Value::Object(mut envelope)) = super::strict_json::from_slice(body) else {
            return Err(bad(
                "body",
                "is not a JSON object (a structured-mode CloudEvent)",
            ));
        };
        if envelope.contains_key("data_base64") {
            return Err(bad(
                "data_base64",
                "binary data cannot be a trigger's payload; send JSON `data`",
            ));
        }
        let data = envelope
            .remove("data")
            .unwrap_or(Value::Object(Default::default()));
        let mut attributes = BTreeMap::new();
        for (k, v) in envelope {
            let text = match v {
                Value::String(s) => s,
                Value::Number(n) => n.to_string(),
                Value::Bool(b) => b.to_string(),
                _ => {
                    return Err((
                        k,
                        "a context attribute is a string, number or boolean".into(),
                    ))
                }
            };
            attributes.insert(k, text);
        }
        (attributes, data)
    } else {
        let attributes: BTreeMap<String, String> = headers
            .iter()
            .filter_map(|(k, v)| Some((k.strip_prefix("ce-")?.to_owned(), v.clone())))
            .collect();
        let data = if body.is_empty() {
            Value::Object(Default::default())
        } else {
            super::strict_json::from_slice(body)
                .map_err(|e| bad("data", &format!("is not JSON: {e}")))?
        };
        // The mode is what the signed body says, not only the unsigned Content-Type: a
        // structured event re-sent as binary mode would be read as other data.
        if data.get("specversion").is_some() {
            return Err(bad(
                "content-type",
                "the body is a structured-mode CloudEvent: send it as application/cloudevents+json",
            ));
        }
        (attributes, data)
    };
    for required in ["specversion", "id", "source", "type"] {
        if attributes.get(required).is_none_or(|v| v.is_empty()) {
            return Err((
                required.to_owned(),
                format!(
                    "is required: a CloudEvent has `{required}` (`ce-{required}` in binary mode)"
                ),
            ));
        }
    }
    if attributes.get("specversion").map(String::as_str) != Some("1.0") {
        return Err(bad("specversion", "must be 1.0"));
    }
    if !data.is_object() {
        return Err(bad(
            "data",
            "must be a JSON object (it becomes the trigger's payload)",
        ));
    }
    Ok(CloudEvent {
        attributes,
        data,
        structured,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cloudevents_mode_is_what_its_signed_body_says() {
        let binary = BTreeMap::from([
            ("ce-specversion".to_owned(), "1.0".to_owned()),
            ("ce-id".to_owned(), "e1".to_owned()),
            ("ce-source".to_owned(), "/s".to_owned()),
            ("ce-type".to_owned(), "t".to_owned()),
            ("content-type".to_owned(), "application/json".to_owned()),
        ]);
        let e = cloud_event(&binary, br#"{"area": "north"}"#).expect("binary");
        assert!(!e.structured);
        let envelope =
            br#"{"specversion": "1.0", "id": "e1", "source": "/s", "type": "t", "data": {}}"#;
        let refused = cloud_event(&binary, envelope).expect_err("a structured body as binary");
        assert_eq!(refused.0, "content-type");
        let structured = BTreeMap::from([(
            "content-type".to_owned(),
            "application/cloudevents+json".to_owned(),
        )]);
        assert!(
            cloud_event(&structured, envelope)
                .expect("structured")
                .structured
        );
        assert!(cloud_event(&structured, br#"{"area": "north"}"#).is_err());
    }
}
