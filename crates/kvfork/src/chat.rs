//! Chat formatting: a model's own Jinja template (GGUF `tokenizer.chat_template`) rendered with
//! minijinja the way Hugging Face's `apply_chat_template` renders it (jinja2 with
//! `trim_blocks`, `lstrip_blocks`, loop controls, `raise_exception`, `strftime_now`, a
//! `tojson` that writes like Python's `json.dumps`, and Python's str/dict/list methods), or one
//! of llama.cpp's built-in templates by name.

use std::ffi::{c_char, CStr, CString};

use llama_cpp_sys_2 as sys;
use minijinja::{Environment, Error as JinjaError, ErrorKind, Value};
use serde_json::Value as Json;

use crate::error::{Error, Result};
use crate::model::Model;

/// A rendered conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FormattedChat {
    /// The text to tokenize (with `parse_special`) and prefill.
    pub prompt: String,
    /// Strings that end an assistant turn besides the end-of-generation tokens.
    pub stop: Vec<String>,
}

/// Turn-end markers of common templates, reported as stop strings when the template uses them.
const KNOWN_TURN_ENDS: [&str; 7] = [
    "<|im_end|>",
    "<|eot_id|>",
    "<end_of_turn>",
    "<|end|>",
    "<|endoftext|>",
    "</s>",
    "<|END_OF_TURN_TOKEN|>",
];

/// llama.cpp's built-in template names (`chatml`, `llama3`, `gemma`, …).
pub fn builtin_templates() -> Vec<String> {
    // SAFETY: with a length of 0 llama.cpp writes nothing and returns the count.
    let n = unsafe { sys::llama_chat_builtin_templates(std::ptr::null_mut(), 0) };
    let mut names: Vec<*const c_char> = vec![std::ptr::null(); n.max(0) as usize];
    // SAFETY: `names` is writable for the `names.len()` pointers passed; llama.cpp writes at
    // most that many and returns the total.
    let n = unsafe { sys::llama_chat_builtin_templates(names.as_mut_ptr(), names.len()) };
    names
        .iter()
        .take(n.max(0) as usize)
        .filter(|p| !p.is_null())
        // SAFETY: non-NULL entries point to the NUL-terminated keys of llama.cpp's static
        // template table, alive for the whole process; they are copied out here.
        .map(|&p| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        .collect()
}

/// Render `messages` (a JSON array of `{role, content, ...}` objects) with `template` (a
/// built-in name or a Jinja string) or the model's own template. `extra` holds further
/// template variables (a JSON object), as `apply_chat_template`'s keyword arguments.
pub fn format_chat(
    model: &Model,
    messages: &Json,
    add_generation_prompt: bool,
    tools: Option<&Json>,
    template: Option<&str>,
    extra: Option<&Json>,
) -> Result<FormattedChat> {
    check_messages(messages)?;
    let source = match template {
        Some(t) if builtin_templates().iter().any(|n| n == t) => {
            let prompt = render_builtin(t, messages, add_generation_prompt)?;
            return Ok(FormattedChat {
                stop: stop_strings(model, &prompt),
                prompt,
            });
        }
        Some(t) => t.to_string(),
        None => model.chat_template().ok_or_else(|| {
            Error::ChatTemplate(
                "the model has no chat template: pass template= (a Jinja string or a built-in \
                 name such as \"chatml\")"
                    .into(),
            )
        })?,
    };
    let mut vars = serde_json::Map::new();
    if let Some(Json::Object(extra)) = extra {
        vars.extend(extra.clone());
    }
    vars.insert("messages".into(), messages.clone());
    vars.insert("add_generation_prompt".into(), add_generation_prompt.into());
    vars.insert("tools".into(), tools.cloned().unwrap_or(Json::Null));
    for (name, token) in [("bos_token", model.bos()), ("eos_token", model.eos())] {
        let text = token.and_then(|t| model.token_to_text(t).ok());
        vars.entry(name).or_insert(text.unwrap_or_default().into());
    }
    let prompt = render_jinja(&source, &Json::Object(vars))?;
    Ok(FormattedChat {
        stop: stop_strings(model, &source),
        prompt,
    })
}

fn check_messages(messages: &Json) -> Result<()> {
    let bad = |i: usize, what: &str| Error::ChatTemplate(format!("messages[{i}]: {what}"));
    let Json::Array(list) = messages else {
        return Err(Error::ChatTemplate(
            "messages must be a list of dicts".into(),
        ));
    };
    for (i, m) in list.iter().enumerate() {
        let Json::Object(m) = m else {
            return Err(bad(i, "must be a dict with 'role' and 'content'"));
        };
        match m.get("role") {
            Some(Json::String(_)) => {}
            _ => return Err(bad(i, "needs a string 'role'")),
        }
        match m.get("content") {
            None | Some(Json::String(_) | Json::Array(_) | Json::Null) => {}
            Some(_) => return Err(bad(i, "'content' must be a string, a list or None")),
        }
        if !m.contains_key("content") && !m.contains_key("tool_calls") {
            return Err(bad(i, "needs 'content' (or 'tool_calls')"));
        }
    }
    Ok(())
}

/// Stop strings: the text of the end-of-turn tokens, and known turn-end markers the template
/// writes.
fn stop_strings(model: &Model, template: &str) -> Vec<String> {
    let mut stop: Vec<String> = Vec::new();
    for token in [model.eos(), model.eot()].into_iter().flatten() {
        if let Ok(text) = model.token_to_text(token) {
            if !text.is_empty() && !stop.contains(&text) {
                stop.push(text);
            }
        }
    }
    for marker in KNOWN_TURN_ENDS {
        if template.contains(marker) && !stop.iter().any(|s| s == marker) {
            stop.push(marker.to_string());
        }
    }
    stop
}

fn jinja_error(e: JinjaError) -> Error {
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        msg.push_str(&format!(": {s}"));
        source = s.source();
    }
    Error::ChatTemplate(msg)
}

/// The instructions one rendering may run: far more than a long conversation takes (a
/// 5,000-message chat renders within it: `test_chat.py`), far less than nested `range` loops,
/// which ran 10^10 before.
const TEMPLATE_FUEL: u64 = 50_000_000;

fn render_jinja(source: &str, vars: &Json) -> Result<String> {
    let mut env = Environment::new();
    // Hugging Face's environment: jinja2 with trim_blocks and lstrip_blocks.
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .map_err(jinja_error)?;
    env.set_syntax(syntax);
    // A template is code a caller may pass: bounded, so that a loop of loops ends in a
    // ChatTemplateError instead of running for hours (see `TEMPLATE_FUEL`).
    env.set_fuel(Some(TEMPLATE_FUEL));
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> std::result::Result<Value, JinjaError> {
            Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
        },
    );
    env.add_function("strftime_now", |format: String| strftime_now(&format));
    env.add_filter("tojson", tojson);
    let template = env.template_from_str(source).map_err(jinja_error)?;
    template
        .render(Value::from(minijinja::value::Serde(vars)))
        .map_err(jinja_error)
}

/// `tojson` as Hugging Face defines it: `json.dumps(x, ensure_ascii=False, indent=indent)`
/// (", " and ": " separators; no HTML escaping; keys in insertion order).
fn tojson(
    value: Value,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<Value, JinjaError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value).map_err(|e| {
        JinjaError::new(
            ErrorKind::InvalidOperation,
            format!("cannot serialize to JSON: {e}"),
        )
    })?;
    let text = match indent {
        Some(n) => {
            let indent = " ".repeat(n);
            let mut out = Vec::new();
            let fmt = serde_json::ser::PrettyFormatter::with_indent(indent.as_bytes());
            let mut ser = serde_json::Serializer::with_formatter(&mut out, fmt);
            serde::Serialize::serialize(&json, &mut ser)
                .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, e.to_string()))?;
            String::from_utf8_lossy(&out).into_owned()
        }
        None => python_json(&json),
    };
    Ok(Value::from_safe_string(text))
}

/// `json.dumps(value, ensure_ascii=False)`.
fn python_json(value: &Json) -> String {
    match value {
        Json::Array(items) => format!(
            "[{}]",
            items.iter().map(python_json).collect::<Vec<_>>().join(", ")
        ),
        Json::Object(map) => format!(
            "{{{}}}",
            map.iter()
                .map(|(k, v)| format!("{}: {}", Json::String(k.clone()), python_json(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        other => other.to_string(),
    }
}

/// The current UTC time formatted like Python's `strftime` (the common directives).
fn strftime_now(format: &str) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()) as i64;
    strftime(format, secs)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// `strftime` for a Unix time (UTC): %Y %y %m %d %e %B %b %A %a %H %M %S %j %%.
pub(crate) fn strftime(format: &str, unix: i64) -> String {
    let days = unix.div_euclid(86_400);
    let secs = unix.rem_euclid(86_400);
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let before = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334][month as usize - 1];
    let yday = before + day + i64::from(leap && month > 2);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out += &year.to_string(),
            Some('y') => out += &format!("{:02}", year.rem_euclid(100)),
            Some('m') => out += &format!("{month:02}"),
            Some('d') => out += &format!("{day:02}"),
            Some('e') => out += &format!("{day:2}"),
            Some('B') => out += MONTHS[month as usize - 1],
            Some('b') => out += &MONTHS[month as usize - 1][..3],
            Some('A') => out += DAYS[weekday],
            Some('a') => out += &DAYS[weekday][..3],
            Some('H') => out += &format!("{:02}", secs / 3600),
            Some('M') => out += &format!("{:02}", secs / 60 % 60),
            Some('S') => out += &format!("{:02}", secs % 60),
            Some('j') => out += &format!("{yday:03}"),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Render with llama.cpp's built-in template `name` (string contents only).
fn render_builtin(name: &str, messages: &Json, add_generation_prompt: bool) -> Result<String> {
    let Json::Array(list) = messages else {
        unreachable!("checked by check_messages")
    };
    let mut owned: Vec<(CString, CString)> = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let role = m["role"].as_str().unwrap_or_default();
        let content = match &m["content"] {
            Json::String(s) => s.as_str(),
            Json::Null => "",
            _ => {
                return Err(Error::ChatTemplate(format!(
                    "messages[{i}]: built-in templates take string contents only"
                )))
            }
        };
        let c = |s: &str| {
            CString::new(s)
                .map_err(|_| Error::ChatTemplate(format!("messages[{i}] has a NUL byte")))
        };
        owned.push((c(role)?, c(content)?));
    }
    let chat: Vec<sys::llama_chat_message> = owned
        .iter()
        .map(|(role, content)| sys::llama_chat_message {
            role: role.as_ptr(),
            content: content.as_ptr(),
        })
        .collect();
    let name_c = CString::new(name).map_err(|_| Error::ChatTemplate("bad template name".into()))?;
    let mut buf = vec![0u8; 4096];
    loop {
        // SAFETY: `chat` holds `chat.len()` messages whose role and content point into
        // `owned`, NUL-terminated and alive for the call, as is `name_c`; `buf` is writable for
        // the length passed (clamped to i32::MAX) and llama.cpp copies at most that many
        // bytes, returning the length it needs (or -1 for an unknown template).
        let n = unsafe {
            sys::llama_chat_apply_template(
                name_c.as_ptr(),
                chat.as_ptr(),
                chat.len(),
                add_generation_prompt,
                buf.as_mut_ptr().cast::<c_char>(),
                buf.len().min(i32::MAX as usize) as i32,
            )
        };
        if n < 0 {
            return Err(Error::ChatTemplate(format!(
                "llama.cpp could not apply the built-in template {name:?}"
            )));
        }
        if (n as usize) <= buf.len() {
            buf.truncate(n as usize);
            return Ok(String::from_utf8_lossy(&buf).into_owned());
        }
        buf.resize(n as usize, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_known_dates() {
        assert_eq!(strftime("%Y-%m-%d %H:%M:%S", 0), "1970-01-01 00:00:00");
        assert_eq!(
            strftime("%d %b %Y, %A", 1_700_000_000),
            "14 Nov 2023, Tuesday"
        );
        assert_eq!(strftime("%j %B %y %%", 951_782_400), "060 February 00 %"); // 2000-02-29
        assert_eq!(strftime("%a %e", -86_400), "Wed 31");
    }

    #[test]
    fn python_json_separators() {
        let v: Json = serde_json::from_str(r#"{"b": [1, 2.5, "x<y"], "a": {"k": null}}"#).unwrap();
        assert_eq!(
            python_json(&v),
            r#"{"b": [1, 2.5, "x<y"], "a": {"k": null}}"#
        );
    }
}
