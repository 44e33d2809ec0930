//! A tracing layer that keeps the attributes of every closed `sense.decision` span, so tests can read the traces.
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::Subscriber;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

pub type Attrs = HashMap<String, String>;

static CLOSED: OnceLock<Mutex<Vec<Attrs>>> = OnceLock::new();

struct Capture;

struct Fields(Attrs);

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        if attrs.metadata().name() != "sense.decision" {
            return;
        }
        let mut f = Fields(Attrs::new());
        attrs.record(&mut f);
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(f);
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id) {
            if let Some(f) = span.extensions_mut().get_mut::<Fields>() {
                values.record(f);
            }
        }
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(&id) {
            if let Some(f) = span.extensions_mut().remove::<Fields>() {
                if let Ok(mut v) = CLOSED.get_or_init(Default::default).lock() {
                    v.push(f.0);
                }
            }
        }
    }
}

/// Installs the capturing subscriber once for the whole test binary.
pub fn install() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        let _ =
            tracing::subscriber::set_global_default(tracing_subscriber::registry().with(Capture));
    });
}

/// The closed decision spans whose attributes match every given pair.
pub fn decisions(matching: &[(&str, &str)]) -> Vec<Attrs> {
    CLOSED
        .get_or_init(Default::default)
        .lock()
        .map(|v| {
            v.iter()
                .filter(|a| {
                    matching
                        .iter()
                        .all(|(k, want)| a.get(*k).map(String::as_str) == Some(*want))
                })
                .cloned()
                .collect()
        })
        .unwrap_or_default()
}
