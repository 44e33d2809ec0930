//! The OpenAPI 3.1 document of the JSON door, written from the same route table and descriptors the door serves by: every path, parameter and schema follows from the protos.
use std::collections::BTreeMap;

use prost_reflect::{DescriptorPool, FieldDescriptor, Kind, MessageDescriptor, MethodDescriptor};
use serde_json::{json, Map, Value};

use super::rules::{BodyRule, Route};

/// The document for `routes`.
pub fn document(routes: &[Route], pool: &DescriptorPool) -> Value {
    let mut schemas = BTreeMap::new();
    let mut paths: BTreeMap<String, Map<String, Value>> = BTreeMap::new();
    for route in routes {
        let op = operation(route, &mut schemas);
        paths
            .entry(route.template.clone())
            .or_default()
            .insert(route.verb.as_str().to_ascii_lowercase(), op);
    }
    status_schemas(pool, &mut schemas);
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "hcp-sense",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "The Sense loop (§7) of the Harness Context Protocol as JSON over HTTP: each operation is one gRPC method of hcp.sense.v1 (its protobuf JSON in, its protobuf JSON out), answered by the same rules. A refusal is a google.rpc.Status with the HTTP status of its code. Credentials: `Authorization: Bearer` with a token or JWT, as over gRPC.",
        },
        "security": [ { "bearer": [] } ],
        "paths": paths,
        "components": {
            "securitySchemes": {
                "bearer": { "type": "http", "scheme": "bearer" },
            },
            "schemas": schemas,
        },
    })
}

fn operation(route: &Route, schemas: &mut BTreeMap<String, Value>) -> Value {
    let m = &route.method;
    let input = m.input();
    let mut parameters = Vec::new();
    let path_fields: Vec<&str> = route.path_fields().collect();
    for f in &path_fields {
        parameters.push(json!({
            "name": f,
            "in": "path",
            "required": true,
            "schema": { "type": "string" },
        }));
    }
    if route.body == BodyRule::None && !m.is_client_streaming() {
        for (name, field) in query_fields(&input, "") {
            if path_fields.contains(&name.as_str()) {
                continue;
            }
            let mut schema = field_schema(&field, schemas);
            if field.is_list() {
                schema = json!({ "type": "array", "items": schema });
            }
            let mut p = json!({ "name": name, "in": "query", "schema": schema });
            if let Some(d) = comments(&field) {
                p["description"] = Value::String(d);
            }
            parameters.push(p);
        }
    }
    if m.is_server_streaming() && input.get_field_by_name("resume_token").is_some() {
        parameters.push(json!({
            "name": "Last-Event-ID",
            "in": "header",
            "description": "The id of the last event received: the stream resumes after it (an EventSource sends it when it reconnects).",
            "schema": { "type": "string" },
        }));
    }
    let output = reference(&m.output(), schemas);
    let ok = if m.is_server_streaming() && !m.is_client_streaming() {
        json!({
            "description": format!("Server-Sent Events: each event's data is one {} as JSON, its id the message's resume_token; a status ending the stream is an `error` event whose data is a google.rpc.Status.", m.output().name()),
            "content": { "text/event-stream": { "schema": { "type": "string" } } },
        })
    } else if m.is_client_streaming() {
        json!({
            "description": format!("One {} as JSON a line, in the order of the requests; a status ending the stream is a last line {{\"error\": google.rpc.Status}}.", m.output().name()),
            "content": { "application/x-ndjson": { "schema": output } },
        })
    } else {
        json!({
            "description": format!("{} as protobuf JSON.", m.output().name()),
            "content": { "application/json": { "schema": output } },
        })
    };
    let mut op = json!({
        "operationId": format!("{}_{}", m.parent_service().name(), m.name()),
        "tags": [m.parent_service().name()],
        "summary": format!("{}.{}", m.parent_service().full_name(), m.name()),
        "parameters": parameters,
        "responses": {
            "200": ok,
            "default": {
                "description": "A refusal: the call's google.rpc.Status (HTTP status from its code; Retry-After from its RetryInfo).",
                "content": { "application/json": { "schema": { "$ref": "#/components/schemas/google.rpc.Status" } } },
            },
        },
    });
    if let Some(d) = method_comments(m) {
        op["description"] = Value::String(d);
    }
    if route.body == BodyRule::Whole || m.is_client_streaming() {
        let input_ref = reference(&input, schemas);
        op["requestBody"] = if m.is_client_streaming() {
            json!({
                "required": true,
                "description": format!("{} requests: a JSON array of them, or one JSON object a line.", input.name()),
                "content": {
                    "application/json": { "schema": { "type": "array", "items": input_ref } },
                    "application/x-ndjson": { "schema": input_ref },
                },
            })
        } else {
            json!({
                "required": true,
                "description": format!("{} as protobuf JSON; path parameters may be left out of it.", input.name()),
                "content": { "application/json": { "schema": input_ref } },
            })
        };
    }
    op
}

/// The query parameters of `message`: its scalar fields by dotted path, nested messages
/// expanded (well-known scalar messages, such as Timestamp, are one parameter).
fn query_fields(message: &MessageDescriptor, prefix: &str) -> Vec<(String, FieldDescriptor)> {
    let mut out = Vec::new();
    for f in message.fields() {
        let name = format!("{prefix}{}", f.name());
        match f.kind() {
            Kind::Message(m) if !scalar_message(&m) => {
                if !f.is_list() && !f.is_map() && !prefix.contains('.') {
                    out.extend(query_fields(&m, &format!("{name}.")));
                }
            }
            _ => out.push((name, f)),
        }
    }
    out
}

fn scalar_message(m: &MessageDescriptor) -> bool {
    m.package_name() == "google.protobuf"
        && !matches!(m.name(), "Struct" | "ListValue" | "Any" | "Empty" | "Value")
}

/// A `$ref` to `message`'s schema, written once into `schemas`.
fn reference(message: &MessageDescriptor, schemas: &mut BTreeMap<String, Value>) -> Value {
    let name = message.full_name().to_owned();
    if !schemas.contains_key(&name) {
        // Placed first, so a message that holds itself refers to itself.
        schemas.insert(name.clone(), json!({}));
        let schema = message_schema(message, schemas);
        schemas.insert(name.clone(), schema);
    }
    json!({ "$ref": format!("#/components/schemas/{name}") })
}

fn message_schema(message: &MessageDescriptor, schemas: &mut BTreeMap<String, Value>) -> Value {
    if let Some(s) = well_known(message) {
        return s;
    }
    let mut properties = Map::new();
    for f in message.fields() {
        let mut s = field_schema(&f, schemas);
        if f.is_list() {
            s = json!({ "type": "array", "items": s });
        }
        if let Some(d) = comments(&f) {
            s = json!({ "allOf": [s], "description": d });
        }
        properties.insert(f.json_name().to_owned(), s);
    }
    let mut s = json!({ "type": "object", "properties": properties });
    if let Some(d) = message_comments(message) {
        s["description"] = Value::String(d);
    }
    s
}

fn field_schema(f: &FieldDescriptor, schemas: &mut BTreeMap<String, Value>) -> Value {
    if f.is_map() {
        if let Kind::Message(entry) = f.kind() {
            let v = field_schema(&entry.map_entry_value_field(), schemas);
            return json!({ "type": "object", "additionalProperties": v });
        }
    }
    match f.kind() {
        Kind::Bool => json!({ "type": "boolean" }),
        Kind::String => json!({ "type": "string" }),
        Kind::Bytes => json!({ "type": "string", "contentEncoding": "base64" }),
        Kind::Double | Kind::Float => json!({ "type": "number" }),
        Kind::Int32 | Kind::Sint32 | Kind::Sfixed32 => {
            json!({ "type": "integer", "format": "int32" })
        }
        Kind::Uint32 | Kind::Fixed32 => {
            json!({ "type": "integer", "format": "int32", "minimum": 0 })
        }
        // The proto3 JSON mapping writes 64-bit integers as strings.
        Kind::Int64 | Kind::Sint64 | Kind::Sfixed64 | Kind::Uint64 | Kind::Fixed64 => {
            json!({ "type": "string", "format": "int64" })
        }
        Kind::Enum(e) => json!({
            "type": "string",
            "enum": e.values().map(|v| v.name().to_owned()).collect::<Vec<_>>(),
        }),
        Kind::Message(m) => reference(&m, schemas),
    }
}

fn well_known(m: &MessageDescriptor) -> Option<Value> {
    if m.package_name() != "google.protobuf" {
        return None;
    }
    Some(match m.name() {
        "Timestamp" => json!({ "type": "string", "format": "date-time" }),
        "Duration" => json!({ "type": "string", "pattern": "^-?[0-9]+(\\.[0-9]+)?s$" }),
        "Struct" => json!({ "type": "object", "additionalProperties": true }),
        "Value" => json!({}),
        "ListValue" => json!({ "type": "array" }),
        "Any" => json!({
            "type": "object",
            "properties": { "@type": { "type": "string" } },
            "additionalProperties": true,
        }),
        "Empty" => json!({ "type": "object" }),
        _ => return None,
    })
}

/// google.rpc.Status and its details, as a refusal carries them.
fn status_schemas(pool: &DescriptorPool, schemas: &mut BTreeMap<String, Value>) {
    if let Some(s) = pool.get_message_by_name("google.rpc.Status") {
        reference(&s, schemas);
    }
    for d in ["BadRequest", "RetryInfo", "ErrorInfo"] {
        if let Some(m) = pool.get_message_by_name(&format!("google.rpc.{d}")) {
            reference(&m, schemas);
        }
    }
}

/// The leading comment of the element at `path` in `file`.
fn comment_at(file: &prost_reflect::FileDescriptor, path: &[i32]) -> Option<String> {
    let info = file.file_descriptor_proto().source_code_info.as_ref()?;
    let loc = info.location.iter().find(|l| l.path == path)?;
    let text = loc.leading_comments.as_deref()?.trim();
    (!text.is_empty()).then(|| text.lines().map(str::trim).collect::<Vec<_>>().join(" "))
}

fn method_comments(m: &MethodDescriptor) -> Option<String> {
    comment_at(&m.parent_file(), m.path())
}

fn message_comments(m: &MessageDescriptor) -> Option<String> {
    comment_at(&m.parent_file(), m.path())
}

fn comments(f: &FieldDescriptor) -> Option<String> {
    comment_at(&f.parent_file(), f.path())
}
