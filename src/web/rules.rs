//! The route table of the JSON door, read from each method's `google.api.http` annotation in the API's descriptors: verb, path template, body.
use prost_reflect::{DescriptorPool, Kind, MethodDescriptor, Value};

/// What a request's body carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyRule {
    /// No body: the fields not in the path come from the query string.
    None,
    /// The whole request message (less the path's fields).
    Whole,
}

/// One segment of a path template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    Literal(String),
    /// A variable matching one segment, naming a field path (`route.route_id`).
    Field(String),
}

/// One route: a method reached by an HTTP verb and path.
#[derive(Debug, Clone)]
pub struct Route {
    pub verb: http::Method,
    /// The template as written (`/v1/packs/{pack_id}`).
    pub template: String,
    pub segments: Vec<Segment>,
    /// A custom verb after the last segment (`:watch`).
    pub custom: Option<String>,
    pub body: BodyRule,
    pub method: MethodDescriptor,
}

impl Route {
    /// The fields named by the template's variables.
    pub fn path_fields(&self) -> impl Iterator<Item = &str> {
        self.segments.iter().filter_map(|s| match s {
            Segment::Field(f) => Some(f.as_str()),
            Segment::Literal(_) => None,
        })
    }

    /// The variables of `path` when it is this route's, in template order, each decoded. A
    /// colon is a custom verb's only on a route with one: `/v1/packs/p/grants/user:alice`
    /// names the principal `user:alice`.
    pub fn matches(&self, path: &str) -> Option<Vec<(String, String)>> {
        let path = path.strip_prefix('/')?;
        let path = match &self.custom {
            Some(verb) => path.strip_suffix(verb.as_str())?.strip_suffix(':')?,
            None => path,
        };
        let segments: Vec<&str> = path.split('/').collect();
        if segments.len() != self.segments.len() {
            return None;
        }
        let mut vars = Vec::new();
        for (want, got) in self.segments.iter().zip(segments) {
            match want {
                Segment::Literal(l) => {
                    if l != got {
                        return None;
                    }
                }
                Segment::Field(f) => {
                    let value = percent_decode(got)?;
                    if value.is_empty() {
                        return None;
                    }
                    vars.push((f.clone(), value));
                }
            }
        }
        Some(vars)
    }
}

/// Splits a template into its segments and custom verb: `/v1/records:watch` is
/// (`["v1", "records"]`, `Some("watch")`). A colon inside an earlier segment is the
/// segment's (`/v1/packs/a:b/grants`).
pub fn split(path: &str) -> (Vec<&str>, Option<&str>) {
    let path = path.strip_prefix('/').unwrap_or(path);
    let mut segments: Vec<&str> = path.split('/').collect();
    let mut custom = None;
    if let Some(last) = segments.last_mut() {
        if let Some((head, verb)) = last.rsplit_once(':') {
            if !verb.is_empty() && verb.bytes().all(|b| b.is_ascii_alphanumeric()) {
                *last = head;
                custom = Some(verb);
            }
        }
    }
    (segments, custom)
}

/// A query string's key or value decoded: `+` is a space (forms), then `%XX`.
pub fn query_decode(s: &str) -> Option<String> {
    percent_decode(&s.replace('+', " "))
}

/// `%XX` decoded; `None` for a malformed escape or bytes that are not UTF-8.
pub fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3)?;
            let hex = std::str::from_utf8(hex).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// Every annotated method of `pool`'s `hcp.sense.v1` services, in the order declared. A
/// method of the API without an annotation, or with one this door cannot serve, is an error:
/// every RPC has its route.
pub fn routes(pool: &DescriptorPool) -> anyhow::Result<Vec<Route>> {
    let http = pool
        .get_extension_by_name("google.api.http")
        .ok_or_else(|| anyhow::anyhow!("the API's descriptors hold no google.api.http"))?;
    let mut out = Vec::new();
    for service in pool.services() {
        if service.package_name() != "hcp.sense.v1" {
            continue;
        }
        for method in service.methods() {
            let options = method.options();
            if !options.has_extension(&http) {
                anyhow::bail!("{} has no google.api.http route", method.full_name());
            }
            let rule = options.get_extension(&http);
            let Value::Message(rule) = rule.as_ref() else {
                anyhow::bail!("{}: google.api.http is not a message", method.full_name());
            };
            out.push(route(rule, &method)?);
        }
    }
    // Literal segments before variables: `/v1/records:watch` is not a record named `:watch`.
    Ok(out)
}

fn route(rule: &prost_reflect::DynamicMessage, method: &MethodDescriptor) -> anyhow::Result<Route> {
    let text = |name: &str| -> String {
        rule.get_field_by_name(name)
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default()
    };
    let mut found = None;
    for (name, verb) in [
        ("get", http::Method::GET),
        ("put", http::Method::PUT),
        ("post", http::Method::POST),
        ("delete", http::Method::DELETE),
        ("patch", http::Method::PATCH),
    ] {
        if rule.has_field_by_name(name) {
            found = Some((verb, text(name)));
        }
    }
    let Some((verb, template)) = found else {
        anyhow::bail!(
            "{}: google.api.http names no verb this door serves",
            method.full_name()
        );
    };
    let body = match text("body").as_str() {
        "" => BodyRule::None,
        "*" => BodyRule::Whole,
        other => anyhow::bail!("{}: body `{other}`: only `*` or none", method.full_name()),
    };
    let (segments, custom) = split(&template);
    let custom = custom.map(str::to_owned);
    let mut parsed = Vec::new();
    for s in segments {
        if let Some(var) = s.strip_prefix('{').and_then(|v| v.strip_suffix('}')) {
            if var.contains('=') {
                anyhow::bail!(
                    "{}: `{s}`: only single-segment variables",
                    method.full_name()
                );
            }
            field(&method.input(), var)
                .filter(|f| f.kind() == Kind::String && !f.is_list())
                .ok_or_else(|| {
                    anyhow::anyhow!("{}: `{var}` is not a string field", method.full_name())
                })?;
            parsed.push(Segment::Field(var.to_owned()));
        } else {
            parsed.push(Segment::Literal(s.to_owned()));
        }
    }
    Ok(Route {
        verb,
        template,
        segments: parsed,
        custom,
        body,
        method: method.clone(),
    })
}

/// The field a dotted path names in `message` (`route.route_id`), each step by its name or
/// JSON name, when each step but the last is a singular message.
pub fn field(
    message: &prost_reflect::MessageDescriptor,
    path: &str,
) -> Option<prost_reflect::FieldDescriptor> {
    let mut at = message.clone();
    let mut steps = path.split('.').peekable();
    while let Some(step) = steps.next() {
        let field = at
            .get_field_by_name(step)
            .or_else(|| at.get_field_by_json_name(step))?;
        if steps.peek().is_none() {
            return Some(field);
        }
        match field.kind() {
            Kind::Message(m) if !field.is_list() && !field.is_map() => at = m,
            _ => return None,
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_custom_verb_is_split_from_the_last_segment_only() {
        assert_eq!(
            split("/v1/records:watch"),
            (vec!["v1", "records"], Some("watch"))
        );
        assert_eq!(
            split("/v1/packs/a:b/grants"),
            (vec!["v1", "packs", "a:b", "grants"], None)
        );
        assert_eq!(split("/v1/packs"), (vec!["v1", "packs"], None));
    }

    #[test]
    fn a_colon_in_a_variable_is_the_variable_s_unless_the_route_has_a_custom_verb() {
        let pool = DescriptorPool::decode(hcp_sense_api::v1::FILE_DESCRIPTOR_SET).expect("pool");
        let routes = routes(&pool).expect("routes");
        let hit = |verb: http::Method, path: &str| {
            routes.iter().find_map(|r| {
                (r.verb == verb)
                    .then(|| r.matches(path).map(|v| (r.method.name().to_owned(), v)))
                    .flatten()
            })
        };
        let (m, vars) = hit(http::Method::DELETE, "/v1/packs/p/grants/user:alice").expect("route");
        assert_eq!(m, "RevokeSenseEnable");
        assert_eq!(
            vars,
            vec![
                ("pack_id".into(), "p".into()),
                ("principal".into(), "user:alice".into())
            ]
        );
        let (m, vars) = hit(
            http::Method::POST,
            "/v1/packs/p/bindings/user%3Aa%2Fb:reportHealth",
        )
        .expect("route");
        assert_eq!(m, "ReportBindingHealth");
        assert_eq!(vars[1], ("principal".into(), "user:a/b".into()));
        assert_eq!(
            hit(http::Method::GET, "/v1/records:watch")
                .expect("route")
                .0,
            "WatchRecords"
        );
        assert_eq!(
            hit(http::Method::GET, "/v1/records/r1").expect("route").0,
            "GetRecord"
        );
        assert!(hit(http::Method::GET, "/v1/records/").is_none());
        assert!(hit(http::Method::GET, "/v1/packs/a/b").is_none());
    }

    #[test]
    fn every_method_of_the_api_has_a_route() {
        let pool = DescriptorPool::decode(hcp_sense_api::v1::FILE_DESCRIPTOR_SET).expect("pool");
        let routes = routes(&pool).expect("routes");
        let methods: usize = pool
            .services()
            .filter(|s| s.package_name() == "hcp.sense.v1")
            .map(|s| s.methods().len())
            .sum();
        assert_eq!(routes.len(), methods);
        let mut seen = std::collections::HashSet::new();
        for r in &routes {
            assert!(
                seen.insert((r.verb.clone(), r.template.clone())),
                "{} twice",
                r.template
            );
        }
    }

    #[test]
    fn a_path_variable_is_percent_decoded_whole() {
        assert_eq!(
            percent_decode("user%3Aalice%2Fx").as_deref(),
            Some("user:alice/x")
        );
        assert_eq!(percent_decode("%zz"), None);
        assert_eq!(percent_decode("%ff"), None);
    }
}
