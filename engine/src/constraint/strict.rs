//! Strict object schemas: what OpenAI's strict mode and forced tool calls take.

/// `schema` with `additionalProperties: false` on every object schema that lists
/// `properties` and says nothing about further ones (no `additionalProperties`,
/// `patternProperties` or `unevaluatedProperties`): what OpenAI's strict mode requires, and
/// what a forced tool call's arguments get, so a model cannot go on inventing properties
/// until `max_tokens`. Schemas combined with `allOf` (and those that hold one) stay open:
/// closing them would forbid the properties their siblings add.
pub fn closed_objects(schema: &serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    fn close(v: &mut Value, in_all_of: bool) {
        let Value::Object(o) = v else { return };
        let open = [
            "additionalProperties",
            "patternProperties",
            "unevaluatedProperties",
        ]
        .iter()
        .any(|k| o.contains_key(*k));
        if !in_all_of && !open && !o.contains_key("allOf") && o.contains_key("properties") {
            o.insert("additionalProperties".into(), Value::Bool(false));
        }
        for (k, child) in o.iter_mut() {
            match k.as_str() {
                "properties" | "$defs" | "definitions" | "dependentSchemas" => {
                    if let Value::Object(m) = child {
                        m.values_mut().for_each(|c| close(c, false));
                    }
                }
                "anyOf" | "oneOf" | "prefixItems" => {
                    if let Value::Array(a) = child {
                        a.iter_mut().for_each(|c| close(c, false));
                    }
                }
                "allOf" => {
                    if let Value::Array(a) = child {
                        a.iter_mut().for_each(|c| close(c, true));
                    }
                }
                "items" | "additionalProperties" | "not" | "if" | "then" | "else" | "contains" => {
                    close(child, false)
                }
                _ => {}
            }
        }
    }
    let mut s = schema.clone();
    close(&mut s, false);
    s
}
