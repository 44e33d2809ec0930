//! A route's message turned into its triggers: the body read (JSON, or a CloudEvent), the mapping evaluated, and what the message names completed by the domain's route rules.
use std::collections::BTreeMap;

use serde_json::Value;

use super::cloudevents::{cloud_event, CloudEvent};
use super::invalid;
use super::mapping::{evaluate, Compiled};
use crate::domain::ingress::{
    named_by_event, named_by_headers, principals_of, triggers_of, IngressKind, Route,
};
use crate::domain::policy::PolicyView;
use crate::domain::trigger::RawTrigger;
use crate::error::{Error, Result};

/// The triggers a message to `route` carries: one, or one per principal when the route fans
/// out. `delivery_id` is the trigger id unless the mapping or the event gives one.
pub fn triggers(
    view: &PolicyView,
    route: &Route,
    compiled: &Compiled,
    headers: &BTreeMap<String, String>,
    body: &[u8],
    delivery_id: String,
) -> Result<Vec<RawTrigger>> {
    let (payload, event) = message(route, headers, body)?;
    let signed = route.kind.signed_headers().is_some();
    let unsigned_event = signed && event.as_ref().is_some_and(|e| !e.structured);
    if unsigned_event {
        unsigned_attributes(route, compiled)?;
    }
    let mut mapped = evaluate(compiled, headers, &payload, event.as_ref())
        .map_err(|(f, d)| invalid(vec![(f, d)]))?;
    if unsigned_event {
        // The event's id is an unsigned header here; the signed delivery id is what makes a
        // replay the first record.
        mapped.trigger_id.get_or_insert_with(|| delivery_id.clone());
    }
    let named = match &event {
        Some(e) => named_by_event(route, e.names(), &mut mapped),
        None if route.kind == IngressKind::Nats => named_by_headers(route, headers, &mut mapped),
        None => Ok(()),
    };
    named.map_err(|fd| invalid(vec![fd]))?;
    let trigger_id = mapped.trigger_id.clone().unwrap_or(delivery_id);
    if signed && trigger_id.is_empty() {
        return Err(Error::invalid(
            "mapping.trigger_id",
            "yielded an empty trigger id: a signed request's trigger id is what makes its replay the first record",
        ));
    }
    let principals = principals_of(view, route, &mapped).map_err(|fd| invalid(vec![fd]))?;
    Ok(triggers_of(
        view,
        route,
        &mapped,
        principals,
        &trigger_id,
        &payload,
    ))
}

/// Refuses a binary-mode CloudEvent on a signed route whose trigger would take its ref,
/// principal or any mapped field from the event's attributes: in binary mode they are `ce-`
/// headers, which the signature (over the body) does not cover, so a replay could change
/// them. Structured mode signs them; a mapping from `body` (the data) needs none of them.
fn unsigned_attributes(route: &Route, compiled: &Compiled) -> Result<()> {
    let why = "in binary mode the event's attributes are ce- headers, which the signature does \
               not cover; send the event in structured mode (application/cloudevents+json), or \
               map the field from `body`";
    if let Some(field) = compiled.reading_event() {
        return Err(Error::invalid(
            format!("mapping.{field}"),
            format!("reads `event`: {why}"),
        ));
    }
    if !compiled.gives("ref") {
        return Err(Error::invalid(
            "ce-type",
            format!("would be the ref (the route maps none): {why}"),
        ));
    }
    let named = compiled.gives("principal") || compiled.gives("binding_id");
    if !named && !route.fan_out {
        return Err(Error::invalid(
            "ce-subject",
            format!("would be the principal (the route maps none): {why}"),
        ));
    }
    Ok(())
}

/// A message's payload, and its CloudEvent when it is one: a CloudEvents route's always, a
/// NATS message's when it carries `ce-` headers or is a structured-mode event (the CloudEvents
/// NATS binding). Any other body must be a JSON object.
fn message(
    route: &Route,
    headers: &BTreeMap<String, String>,
    body: &[u8],
) -> Result<(Value, Option<CloudEvent>)> {
    let is_event = match route.kind {
        IngressKind::CloudEvents => true,
        IngressKind::Nats => {
            headers.contains_key("ce-specversion")
                || headers
                    .get("content-type")
                    .is_some_and(|c| c.starts_with("application/cloudevents"))
        }
        _ => false,
    };
    if is_event {
        let e = cloud_event(headers, body).map_err(|(f, d)| invalid(vec![(f, d)]))?;
        return Ok((e.data.clone(), Some(e)));
    }
    let payload: Value = super::strict_json::from_slice(body)
        .map_err(|e| Error::invalid("body", format!("is not JSON: {e}")))?;
    if !payload.is_object() {
        return Err(Error::invalid("body", "must be a JSON object"));
    }
    Ok((payload, None))
}
