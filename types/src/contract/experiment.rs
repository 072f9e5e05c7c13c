//! The grammar of the online policy experiment's arms (`serve --policy-experiment`, the
//! CRD's `scheduler.experiment.arms`), written once: `dspark`, `none`, `fixed:G` with G a
//! block size in 1..=[`MAX_GAMMA`] written without leading zeros, or `threshold:T` with T in
//! [0, 1] written `0`, `1`, `1.0...`, `0.DIGITS` or `.DIGITS`.
//!
//! The engine parses its flag with [`parse_arms`]; the CRD's rule is [`arm_pattern`], which
//! accepts exactly the arms [`parse_arm`] accepts (a test in the operator evaluates the CRD's
//! rule against this parser).

/// The largest draft block (`--gamma`, `fixed:G`, the CRD's `scheduler.gamma`).
pub const MAX_GAMMA: u32 = 64;

/// The policy of one arm.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ArmKind {
    /// The DSpark scheduler at the engine's gamma.
    Dspark,
    /// Speculation off.
    None,
    /// Every draft position up to `G`.
    Fixed(u32),
    /// The prefix whose survival stays above `T`, at the engine's gamma.
    Threshold(f32),
}

/// The message of an arm that does not parse, naming the grammar.
pub const ARM_GRAMMAR: &str = "dspark, none, fixed:G (G in 1..64) or threshold:T (T in [0, 1])";

/// Whether `s` is a decimal in [0, 1] as the grammar writes it.
fn threshold_text(s: &str) -> bool {
    let digits = |d: &str| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit());
    match s.split_once('.') {
        None => s == "0" || s == "1",
        Some(("" | "0", frac)) => digits(frac),
        Some(("1", frac)) => digits(frac) && frac.bytes().all(|b| b == b'0'),
        Some(_) => false,
    }
}

/// Whether `s` is a block size in 1..=MAX_GAMMA without leading zeros.
fn gamma_text(s: &str) -> Option<u32> {
    let ok = !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) && !s.starts_with('0');
    ok.then(|| s.parse().ok())
        .flatten()
        .filter(|g| (1..=MAX_GAMMA).contains(g))
}

/// Parses one arm.
pub fn parse_arm(raw: &str) -> Result<ArmKind, String> {
    let (kind, val) = match raw.split_once(':') {
        Some((k, v)) => (k, Some(v)),
        None => (raw, None),
    };
    match (kind, val) {
        ("dspark", None) => Ok(ArmKind::Dspark),
        ("none", None) => Ok(ArmKind::None),
        ("fixed", Some(v)) => gamma_text(v)
            .map(ArmKind::Fixed)
            .ok_or_else(|| format!("arm '{raw}': fixed:G needs a block size G in 1..{MAX_GAMMA}")),
        ("threshold", Some(v)) if threshold_text(v) => v
            .parse()
            .map(ArmKind::Threshold)
            .map_err(|_| format!("arm '{raw}': threshold:T needs T in [0, 1]")),
        ("threshold", Some(_)) => Err(format!("arm '{raw}': threshold:T needs T in [0, 1]")),
        _ => Err(format!("unknown arm '{raw}'; use {ARM_GRAMMAR}")),
    }
}

/// Parses `--policy-experiment`: comma-separated arms (spaces around them ignored), at least
/// two, none twice. Each arm comes back with its label as given.
pub fn parse_arms(spec: &str) -> Result<Vec<(String, ArmKind)>, String> {
    let mut arms: Vec<(String, ArmKind)> = Vec::new();
    for raw in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let kind = parse_arm(raw)?;
        if arms.iter().any(|(l, _)| l == raw) {
            return Err(format!("arm '{raw}' is listed twice"));
        }
        arms.push((raw.to_string(), kind));
    }
    if arms.len() < 2 {
        return Err(format!(
            "--policy-experiment needs at least two arms (e.g. dspark,none), got '{spec}'"
        ));
    }
    Ok(arms)
}

/// The regular expression (RE2 and Rust `regex`, no backslash) accepting exactly the arms
/// [`parse_arm`] accepts.
pub fn arm_pattern() -> String {
    // 1..=64 without leading zeros.
    const GAMMA: &str = "([1-9]|[1-5][0-9]|6[0-4])";
    const _: () = assert!(MAX_GAMMA == 64, "GAMMA spells 1..64");
    format!("^(dspark|none|fixed:{GAMMA}|threshold:(0|1|0?[.][0-9]+|1[.]0+))$")
}
