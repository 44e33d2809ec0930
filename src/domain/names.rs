//! Syntax of the names the spec uses: trigger refs (§7.1.2), lands, pack ids.

/// Longest ref, land or pack id accepted; longer ones are refused rather than truncated.
pub const MAX_REF_LEN: usize = 256;
pub const MAX_PACK_ID_LEN: usize = 128;
pub const MAX_LAND_LEN: usize = 64;
/// Longest principal, project, Binding or trigger id accepted.
pub const MAX_ID_LEN: usize = 256;

/// Checks a principal, project, Binding or trigger id: 1 to 256 bytes, with no
/// whitespace, no `=`, no control characters and no invisible formatting characters. Ids are
/// written into logs and spans as `key=value`; a space or `=` inside one could forge another
/// field, and a zero-width or direction-changing character makes an id that reads as another
/// (`alice\u{200B}` as `alice`).
pub fn check_id(what: &str, id: &str) -> Result<(), String> {
    if id.is_empty() {
        return Err(format!("{what} must be non-empty"));
    }
    if id.len() > MAX_ID_LEN {
        return Err(format!("{what} must be at most {MAX_ID_LEN} bytes"));
    }
    if id.chars().any(char::is_control) {
        return Err(format!("{what} must not contain control characters"));
    }
    if id.chars().any(char::is_whitespace) {
        return Err(format!("{what} must not contain whitespace"));
    }
    if id.contains('=') {
        return Err(format!("{what} must not contain `=`"));
    }
    if let Some(c) = id.chars().find(|c| is_invisible(*c)) {
        return Err(format!(
            "{what} must not contain invisible formatting characters (U+{:04X})",
            u32::from(c)
        ));
    }
    Ok(())
}

/// Characters that render as nothing, as a blank, or reorder the text around them, and those
/// with no meaning of their own: Unicode's default-ignorable code points (soft hyphen,
/// combining grapheme joiner, Hangul fillers, zero-width and joiner characters, direction
/// marks, embeddings, overrides and isolates, invisible operators, variation selectors, the
/// byte-order mark, musical and shorthand format controls, tags), interlinear annotation, the
/// blank braille pattern, private-use characters and noncharacters.
fn is_invisible(c: char) -> bool {
    let n = u32::from(c);
    matches!(c,
        '\u{00AD}' | '\u{034F}' | '\u{061C}' | '\u{115F}' | '\u{1160}' | '\u{17B4}' | '\u{17B5}'
        | '\u{180B}'..='\u{180F}' | '\u{200B}'..='\u{200F}' | '\u{202A}'..='\u{202E}'
        | '\u{2060}'..='\u{206F}' | '\u{2800}' | '\u{3164}' | '\u{FE00}'..='\u{FE0F}' | '\u{FEFF}'
        | '\u{FFA0}' | '\u{FFF0}'..='\u{FFFB}' | '\u{1BCA0}'..='\u{1BCA3}'
        | '\u{1D173}'..='\u{1D17A}' | '\u{E0000}'..='\u{E0FFF}'
        // Private use.
        | '\u{E000}'..='\u{F8FF}' | '\u{F0000}'..='\u{10FFFF}'
        // Noncharacters.
        | '\u{FDD0}'..='\u{FDEF}')
        || n & 0xFFFE == 0xFFFE
}

/// Checks a trigger ref against §7.1.2: non-empty, lower-case, `.` separating
/// non-empty segments of `[a-z0-9_-]`. Returns the rule broken, in words.
pub fn check_ref(r: &str) -> Result<(), String> {
    if r.is_empty() {
        return Err("ref must be non-empty".into());
    }
    if r.len() > MAX_REF_LEN {
        return Err(format!("ref must be at most {MAX_REF_LEN} bytes"));
    }
    if r.chars().any(|c| c.is_uppercase()) {
        return Err(format!("ref `{r}` must be lower-case"));
    }
    for seg in r.split('.') {
        if seg.is_empty() {
            return Err(format!(
                "ref `{r}` has an empty segment: `.` only separates non-empty segments"
            ));
        }
        if let Some(c) = seg.chars().find(|c| !is_name_char(*c)) {
            return Err(format!(
                "ref `{r}` contains {c:?}; segments use only a-z, 0-9, `_` and `-`"
            ));
        }
    }
    Ok(())
}

/// Checks a land name: a lower-case name such as `user`, `project` or `brain`.
pub fn check_land(land: &str) -> Result<(), String> {
    if land.is_empty() {
        return Err("land must be non-empty".into());
    }
    if land.len() > MAX_LAND_LEN {
        return Err(format!("land must be at most {MAX_LAND_LEN} bytes"));
    }
    let first_ok = land.chars().next().is_some_and(|c| c.is_ascii_lowercase());
    if !first_ok || !land.chars().all(is_name_char) {
        return Err(format!(
            "land `{land}` must be a lower-case name: a-z first, then a-z, 0-9, `_` or `-`"
        ));
    }
    Ok(())
}

/// Checks a pack id: 1 to 128 characters of `[A-Za-z0-9._-]`, starting with a letter or digit.
pub fn check_pack_id(id: &str) -> Result<(), String> {
    if id.is_empty() {
        return Err("pack id must be non-empty".into());
    }
    if id.len() > MAX_PACK_ID_LEN {
        return Err(format!("pack id must be at most {MAX_PACK_ID_LEN} bytes"));
    }
    let first_ok = id.chars().next().is_some_and(|c| c.is_ascii_alphanumeric());
    let rest_ok = id
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if !first_ok || !rest_ok {
        return Err(format!(
            "pack id `{id}` may use only A-Z, a-z, 0-9, `.`, `_` and `-`, starting with a letter or digit"
        ));
    }
    Ok(())
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-'
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn s7_1_2_ref_syntax() {
        for ok in ["issue", "issue.opened", "binding.degraded", "a_b-c.d9", "x"] {
            assert!(check_ref(ok).is_ok(), "{ok} should pass");
        }
        for bad in [
            "",
            "Issue",
            "issue.Opened",
            "a..b",
            ".a",
            "a.",
            "a b",
            "a/b",
            "é",
            "a:b",
        ] {
            assert!(check_ref(bad).is_err(), "{bad:?} should fail");
        }
    }

    #[test]
    fn ids_refuse_what_could_forge_a_log_field() {
        for ok in [
            "alice",
            "u:42",
            "spiffe://corp/ns/a",
            "é",
            &"x".repeat(MAX_ID_LEN),
        ] {
            assert!(check_id("principal", ok).is_ok(), "{ok:?} should pass");
        }
        for bad in [
            "",
            "alice bob",
            "a=b",
            "alice\tx",
            "a\u{85}b",
            "a\u{a0}b",
            "a\u{2028}b",
            " alice",
            "x\u{1b}[31m",
            &"x".repeat(MAX_ID_LEN + 1),
            "alice\u{200b}",
            "\u{feff}alice",
            "evil\u{202e}ecila",
            "a\u{2066}b",
            "a\u{ad}b",
            "a\u{e0041}",
            "alice\u{3164}",
            "alice\u{2800}",
            "alice\u{fe0f}",
            "alice\u{e0100}",
            "a\u{34f}b",
            "a\u{1d173}",
            "a\u{1bca0}",
            "a\u{e000}",
            "a\u{fdd0}",
            "a\u{10ffff}",
            "a\u{fffe}",
        ] {
            assert!(check_id("principal", bad).is_err(), "{bad:?} should fail");
        }
        let e = check_id("trigger_id", "t\u{202e}1").expect_err("an override");
        assert!(e.contains("trigger_id") && e.contains("U+202E"), "{e}");
        // Joiners inside emoji and scripts that need them are refused too: ids are
        // identifiers, not text.
        assert!(check_id("principal", "a\u{200d}b").is_err());
    }

    #[test]
    fn land_syntax() {
        assert!(check_land("brain").is_ok());
        assert!(check_land("").is_err());
        assert!(check_land("Brain").is_err());
        assert!(check_land("1x").is_err());
    }
}
