//! A focused validator of JSON values against the definitions of an OpenAPI 2.0 (swagger) document: the
//! subset the ACI spec uses for request bodies, read strictly.
//!
//! It follows `$ref` (local `#/definitions/..`), merges `allOf`, and checks `type`, `format: int32`
//! ranges, `enum`, `required`, `items` and `additionalProperties`. It is stricter than ARM in two ways, on
//! purpose: a property the schema does not declare is an error (ARM ignores unknown properties silently,
//! so a misspelt `memoryInGb` would otherwise pass and the worker would get the default), and so is a
//! `readOnly` property in a request. An enum marked `modelAsString` (extensible) is still checked against
//! its listed values.
//!
//! The document's only external references are to ARM's `common-types`; of those, request bodies reach
//! only `ProxyResource` (through `allOf`), whose properties (`id`, `name`, `type`, `systemData`) are all
//! read-only. It stands in here as exactly that. Any other external reference is reported, not skipped.

use serde_json::{Map, Value, json};

pub struct Swagger {
    definitions: Map<String, Value>,
}

impl Swagger {
    pub fn load(path: &std::path::Path) -> Swagger {
        let text = std::fs::read_to_string(path)
            .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        let doc: Value = serde_json::from_str(&text).expect("the spec is JSON");
        assert_eq!(
            doc["swagger"],
            "2.0",
            "{} is not a swagger 2.0 document",
            path.display()
        );
        Swagger {
            definitions: doc["definitions"].as_object().expect("definitions").clone(),
        }
    }

    /// Every way `value` breaks definition `name`, as `path: problem`.
    pub fn validate(&self, name: &str, value: &Value) -> Vec<String> {
        let mut errors = Vec::new();
        let schema = json!({ "$ref": format!("#/definitions/{name}") });
        self.check(&schema, value, "$", &mut errors);
        errors
    }

    fn resolve(&self, reference: &str, path: &str, errors: &mut Vec<String>) -> Option<Value> {
        if let Some(local) = reference.strip_prefix("#/definitions/") {
            return match self.definitions.get(local) {
                Some(d) => Some(d.clone()),
                None => {
                    errors.push(format!("{path}: the spec has no definition {local}"));
                    None
                }
            };
        }
        if reference
            .ends_with("common-types/resource-management/v5/types.json#/definitions/ProxyResource")
        {
            let ro = |t: &str| json!({ "type": t, "readOnly": true });
            return Some(json!({
                "type": "object",
                "properties": {
                    "id": ro("string"), "name": ro("string"), "type": ro("string"),
                    "systemData": ro("object")
                }
            }));
        }
        errors.push(format!("{path}: unresolved external reference {reference}"));
        None
    }

    /// The schema with `$ref` followed and `allOf` parts merged into `properties` and `required`.
    fn flatten(&self, schema: &Value, path: &str, errors: &mut Vec<String>) -> Value {
        let mut schema = schema.clone();
        while let Some(r) = schema
            .get("$ref")
            .and_then(Value::as_str)
            .map(str::to_string)
        {
            match self.resolve(&r, path, errors) {
                Some(s) => schema = s,
                None => return json!({}),
            }
        }
        if let Some(parts) = schema.get("allOf").and_then(Value::as_array).cloned() {
            let obj = schema
                .as_object_mut()
                .expect("a schema with allOf is an object");
            obj.remove("allOf");
            for part in parts {
                let part = self.flatten(&part, path, errors);
                if let Some(props) = part.get("properties").and_then(Value::as_object) {
                    let mine = obj
                        .entry("properties")
                        .or_insert_with(|| json!({}))
                        .as_object_mut()
                        .expect("properties is an object");
                    for (k, v) in props {
                        mine.entry(k.clone()).or_insert_with(|| v.clone());
                    }
                }
                if let Some(req) = part.get("required").and_then(Value::as_array) {
                    let mine = obj
                        .entry("required")
                        .or_insert_with(|| json!([]))
                        .as_array_mut()
                        .expect("required is an array");
                    mine.extend(req.iter().cloned());
                }
                if obj.get("type").is_none()
                    && let Some(t) = part.get("type")
                {
                    obj.insert("type".into(), t.clone());
                }
            }
        }
        schema
    }

    fn check(&self, schema: &Value, v: &Value, path: &str, errors: &mut Vec<String>) {
        if schema.get("readOnly") == Some(&Value::Bool(true)) {
            errors.push(format!("{path}: read-only property sent in a request"));
            return;
        }
        let schema = self.flatten(schema, path, errors);
        if schema.get("readOnly") == Some(&Value::Bool(true)) {
            errors.push(format!("{path}: read-only property sent in a request"));
            return;
        }
        let ty = schema
            .get("type")
            .and_then(Value::as_str)
            .or_else(|| schema.get("properties").map(|_| "object"));
        match ty {
            Some("object") => self.check_object(&schema, v, path, errors),
            Some("array") => match v.as_array() {
                Some(items) => {
                    let item_schema = schema.get("items").cloned().unwrap_or(json!({}));
                    for (i, item) in items.iter().enumerate() {
                        self.check(&item_schema, item, &format!("{path}[{i}]"), errors);
                    }
                }
                None => errors.push(format!("{path}: expected an array, got {v}")),
            },
            Some(t @ ("string" | "boolean" | "number")) => {
                let ok = match t {
                    "string" => v.is_string(),
                    "boolean" => v.is_boolean(),
                    _ => v.is_number(),
                };
                if !ok {
                    errors.push(format!("{path}: expected a {t}, got {v}"));
                }
            }
            Some("integer") => match v.as_i64() {
                Some(i) => {
                    let int32 = schema.get("format").and_then(Value::as_str) == Some("int32");
                    if int32 && i32::try_from(i).is_err() {
                        errors.push(format!("{path}: {i} does not fit int32"));
                    }
                }
                None => errors.push(format!("{path}: expected an integer, got {v}")),
            },
            Some(other) => errors.push(format!("{path}: the validator does not know type {other}")),
            // No type and no properties (e.g. `emptyDir`): anything goes.
            None => {}
        }
        if let Some(allowed) = schema.get("enum").and_then(Value::as_array)
            && !allowed.contains(v)
        {
            errors.push(format!(
                "{path}: {v} is not one of {}",
                Value::Array(allowed.clone())
            ));
        }
    }

    fn check_object(&self, schema: &Value, v: &Value, path: &str, errors: &mut Vec<String>) {
        let Some(obj) = v.as_object() else {
            errors.push(format!("{path}: expected an object, got {v}"));
            return;
        };
        let empty = Map::new();
        let props = schema
            .get("properties")
            .and_then(Value::as_object)
            .unwrap_or(&empty);
        for req in schema
            .get("required")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let name = req.as_str().unwrap_or("");
            if !obj.contains_key(name) {
                errors.push(format!("{path}: required property {name} is missing"));
            }
        }
        let additional = schema.get("additionalProperties");
        for (k, value) in obj {
            let child = format!("{path}.{k}");
            match (props.get(k), additional) {
                (Some(s), _) => self.check(s, value, &child, errors),
                (None, Some(Value::Bool(true))) => {}
                (None, Some(s @ Value::Object(_))) => self.check(s, value, &child, errors),
                (None, _) => errors.push(format!("{child}: not a property the spec declares")),
            }
        }
    }
}
