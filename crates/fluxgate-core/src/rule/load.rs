//! Loading: rule files and texts in YAML, TOML or JSON.

use std::fmt;
use std::path::Path;

use super::{RuleSetSpec, RuleSets, RuleSpec, ShapeError};
use crate::error::RuleError;

/// The rule formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Format {
    /// YAML (`.yaml`, `.yml`).
    Yaml,
    /// TOML (`.toml`).
    Toml,
    /// JSON (`.json`).
    Json,
}

impl Format {
    /// The format for a file name's extension.
    pub fn from_path(path: &Path) -> Option<Self> {
        match path.extension()?.to_str()?.to_ascii_lowercase().as_str() {
            "yaml" | "yml" => Some(Self::Yaml),
            "toml" => Some(Self::Toml),
            "json" => Some(Self::Json),
            _ => None,
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Yaml => "YAML",
            Self::Toml => "TOML",
            Self::Json => "JSON",
        })
    }
}

impl RuleSets {
    /// Parses and validates rules in the given format.
    ///
    /// # Errors
    ///
    /// [`RuleError::Syntax`] for text that is not valid in the format, and
    /// [`RuleError::Invalid`] naming the rule set, the rule and the field otherwise.
    pub fn parse(text: &str, format: Format) -> Result<Self, RuleError> {
        let syntax = |message: String| RuleError::Syntax { format, message };
        // TOML refuses a key given twice itself; YAML and JSON are read refusing it too, so
        // that a field given twice (`bands` with a tight limit, then with a loose one) is
        // not taken silently from its last occurrence.
        let value: serde_json::Value = match format {
            Format::Yaml => {
                bracket_bound(text).map_err(syntax)?;
                yaml_serde::from_str::<Unique>(text)
                    .map_err(|e| syntax(yaml_error(&e)))?
                    .0
            }
            Format::Toml => toml::from_str(text).map_err(|e| syntax(e.to_string()))?,
            Format::Json => {
                serde_json::from_str::<Unique>(text)
                    .map_err(|e| syntax(e.to_string()))?
                    .0
            }
        };
        Self::from_specs(specs_from_value(value)?)
    }

    /// Parses YAML rules.
    ///
    /// # Errors
    ///
    /// See [`RuleSets::parse`].
    pub fn from_yaml_str(text: &str) -> Result<Self, RuleError> {
        Self::parse(text, Format::Yaml)
    }

    /// Parses TOML rules.
    ///
    /// # Errors
    ///
    /// See [`RuleSets::parse`].
    pub fn from_toml_str(text: &str) -> Result<Self, RuleError> {
        Self::parse(text, Format::Toml)
    }

    /// Parses JSON rules.
    ///
    /// # Errors
    ///
    /// See [`RuleSets::parse`].
    pub fn from_json_str(text: &str) -> Result<Self, RuleError> {
        Self::parse(text, Format::Json)
    }

    /// Reads a rule file; the extension (`.yaml`, `.yml`, `.toml`, `.json`) picks the format.
    ///
    /// # Errors
    ///
    /// [`RuleError::File`] naming the file and what is wrong in it.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, RuleError> {
        let path = path.as_ref();
        let wrap = |source: RuleError| RuleError::File {
            path: path.to_owned(),
            source: Box::new(source),
        };
        let format = Format::from_path(path).ok_or_else(|| wrap(RuleError::UnknownFormat))?;
        let text = read_rule_file(path).map_err(|e| wrap(RuleError::Io(e)))?;
        Self::parse(&text, format).map_err(wrap)
    }
}

/// The largest rule file read: 16 MiB. A larger file is refused before it is read.
pub const MAX_RULE_FILE: u64 = 16 * 1024 * 1024;

/// Reads a rule file: a regular file (following symbolic links; a device or a pipe could
/// block or never end) of at most [`MAX_RULE_FILE`] bytes.
fn read_rule_file(path: &Path) -> std::io::Result<String> {
    use std::io::{Error, ErrorKind, Read};
    // Before opening: opening a pipe blocks until a writer comes.
    let metadata = std::fs::metadata(path)?;
    if !metadata.is_file() {
        return Err(Error::new(ErrorKind::InvalidInput, "not a regular file"));
    }
    let too_large = || {
        Error::new(
            ErrorKind::InvalidData,
            format!("larger than {MAX_RULE_FILE} bytes, the most a rule file may hold"),
        )
    };
    if metadata.len() > MAX_RULE_FILE {
        return Err(too_large());
    }
    let file = std::fs::File::open(path)?;
    let mut text = String::new();
    // The file may grow while it is read.
    file.take(MAX_RULE_FILE + 1).read_to_string(&mut text)?;
    if text.len() as u64 > MAX_RULE_FILE {
        return Err(too_large());
    }
    Ok(text)
}

/// The most `[` and `{` a YAML rule file may hold: about 10,000 rules written with their
/// bands in flow style (`bands: [{ capacity: 10, window: 1s }]`).
const MAX_YAML_BRACKETS: usize = 20_000;

/// Refuses YAML with more than [`MAX_YAML_BRACKETS`] `[` and `{`, wherever they are, before
/// the reader sees it. The reader takes time in the square of the nesting of flow
/// collections before it refuses nesting past its limit (3 s for 40,000 brackets, hours for
/// a file of a few megabytes); no nesting is deeper than the brackets there are, so this
/// bounds that time (about 0.7 s) however the brackets are written. Telling which brackets
/// are indicators would take YAML's own lexical rules, which a second reader of them gets
/// wrong. JSON and TOML have no such limit.
fn bracket_bound(text: &str) -> Result<(), String> {
    let mut brackets = 0usize;
    for (line, text) in text.split('\n').enumerate() {
        brackets += text.bytes().filter(|&b| b == b'[' || b == b'{').count();
        if brackets > MAX_YAML_BRACKETS {
            return Err(format!(
                "more than {MAX_YAML_BRACKETS} `[` and `{{` by line {}: write a rule file this \
                 large in JSON or TOML, or its YAML in block style",
                line + 1
            ));
        }
    }
    Ok(())
}

/// The YAML parser's message, with the place it names: it leaves out `line 1 column 1`, and a
/// few errors have no position at all.
fn yaml_error(e: &yaml_serde::Error) -> String {
    let message = e.to_string();
    match e.location() {
        Some(at) if !message.contains(" at line ") => {
            format!("{message} at line {} column {}", at.line(), at.column())
        }
        Some(_) => message,
        None => format!("{message} (in the text as a whole)"),
    }
}

/// Deserializes the specs one rule at a time, so errors name the rule set, the rule and
/// the field whatever the format.
fn specs_from_value(value: serde_json::Value) -> Result<Vec<RuleSetSpec>, RuleError> {
    use serde_json::Value;
    let top = |shape: ShapeError| RuleError::at("-", "-", shape);
    let mut obj = match value {
        Value::Object(obj) => obj,
        Value::Null => return Err(top(ShapeError::Empty)),
        _ => return Err(top(ShapeError::NotAMap)),
    };
    if let Some(key) = obj.keys().find(|k| *k != "rule_sets") {
        return Err(top(ShapeError::UnknownField { field: key.clone() }));
    }
    let sets = match obj.remove("rule_sets") {
        Some(Value::Array(sets)) => sets,
        Some(_) => return Err(top(ShapeError::RuleSetsNotAList)),
        None => return Err(top(ShapeError::MissingRuleSets)),
    };
    let mut specs = Vec::with_capacity(sets.len());
    for (i, set) in sets.into_iter().enumerate() {
        let Value::Object(mut set) = set else {
            return Err(RuleError::at(&format!("#{}", i + 1), "-", ShapeError::RuleSetNotAMap));
        };
        let set_name = match set.get("id") {
            Some(Value::String(id)) if !id.is_empty() => id.clone(),
            _ => format!("#{}", i + 1),
        };
        let rules = match set.remove("rules") {
            Some(Value::Array(rules)) => rules,
            Some(Value::Null) | None => Vec::new(),
            Some(_) => return Err(RuleError::at(&set_name, "-", ShapeError::RulesNotAList)),
        };
        let mut spec: RuleSetSpec =
            deserialize_at(Value::Object(set)).map_err(|(field, m)| RuleError::invalid(&set_name, "-", &field, m))?;
        for (j, rule) in rules.into_iter().enumerate() {
            let rule_name = match rule.get("id") {
                Some(Value::String(id)) if !id.is_empty() => id.clone(),
                _ => format!("#{}", j + 1),
            };
            let rule: RuleSpec =
                deserialize_at(rule).map_err(|(field, m)| RuleError::invalid(&set_name, &rule_name, &field, m))?;
            spec.rules.push(rule);
        }
        specs.push(spec);
    }
    Ok(specs)
}

fn deserialize_at<T: serde::de::DeserializeOwned>(value: serde_json::Value) -> Result<T, (String, String)> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let message = e.into_inner().to_string();
        // A missing field is reported at its parent: name the field itself.
        let missing = message
            .strip_prefix("missing field `")
            .and_then(|rest| rest.split('`').next())
            .map(str::to_owned);
        let field = match (path.as_str(), missing) {
            (".", Some(name)) => name,
            (".", None) => "-".to_owned(),
            (parent, Some(name)) => format!("{parent}.{name}"),
            (parent, None) => parent.to_owned(),
        };
        (field, message)
    })
}

/// A document read as a [`serde_json::Value`], refusing a map that gives a key twice (the
/// format's error then names the key and where it is).
struct Unique(serde_json::Value);

impl<'de> serde::Deserialize<'de> for Unique {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(UniqueVisitor).map(Unique)
    }
}

struct UniqueVisitor;

impl<'de> serde::de::Visitor<'de> for UniqueVisitor {
    type Value = serde_json::Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Self::Value, E> {
        // YAML's `.nan` and `.inf`: no field holds one, and read as `null` they would pass
        // as an absent value (`rules: .nan` as a rule set without rules).
        serde_json::Number::from_f64(v)
            .map(serde_json::Value::Number)
            .ok_or_else(|| E::custom(format_args!("`{v}` is not a finite number")))
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(serde_json::Value::Null)
    }

    fn visit_none<E>(self) -> Result<Self::Value, E> {
        Ok(serde_json::Value::Null)
    }

    fn visit_some<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_any(self)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items = Vec::new();
        while let Some(Unique(item)) = seq.next_element()? {
            items.push(item);
        }
        Ok(serde_json::Value::Array(items))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut fields = serde_json::Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if fields.contains_key(&key) {
                let shown: String = key.chars().take(64).collect();
                return Err(serde::de::Error::custom(format_args!(
                    "the key `{shown}` is given twice in one map"
                )));
            }
            let Unique(value) = map.next_value()?;
            fields.insert(key, value);
        }
        Ok(serde_json::Value::Object(fields))
    }
}
