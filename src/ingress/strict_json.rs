//! A signed body read as JSON that refuses an object naming one key twice: parsers disagree on which of the two wins, so a sender and this service could read one signed body differently.
use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

/// `bytes` as JSON; an object with a repeated key is an error naming the key.
pub fn from_slice(bytes: &[u8]) -> Result<Value, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let v = Strict.deserialize(&mut de)?;
    de.end()?;
    Ok(v)
}

struct Strict;

impl<'de> DeserializeSeed<'de> for Strict {
    type Value = Value;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Strict {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(v.into())
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(v.into())
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::new();
        while let Some(v) = seq.next_element_seed(Strict)? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(k) = map.next_key::<String>()? {
            let v = map.next_value_seed(Strict)?;
            if out.contains_key(&k) {
                return Err(serde::de::Error::custom(format_args!(
                    "the key `{}` appears twice in one object",
                    k.escape_debug()
                )));
            }
            out.insert(k, v);
        }
        Ok(Value::Object(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeated_key_is_refused_at_any_depth_and_the_rest_reads_as_serde_json_does() {
        for body in [
            r#"{"user":"alice","user":"bob"}"#,
            r#"{"a":{"x":1,"x":1}}"#,
            r#"[{"k":1},{"k":2,"k":3}]"#,
        ] {
            let e = from_slice(body.as_bytes()).expect_err(body);
            assert!(e.to_string().contains("appears twice"), "{e}");
        }
        for body in [
            r#"{"user":"alice","area":{"n":1.5,"tags":["a","b"],"x":null,"ok":true}}"#,
            r#"{"big":18446744073709551615,"neg":-3,"s":"\u00e9"}"#,
            "[]",
        ] {
            let want: Value = serde_json::from_str(body).expect("json");
            assert_eq!(from_slice(body.as_bytes()).expect(body), want);
        }
        assert!(from_slice(b"{\"a\":1} x").is_err(), "trailing bytes");
        assert!(from_slice(&b"[".repeat(200)).is_err(), "recursion limit");
    }
}
