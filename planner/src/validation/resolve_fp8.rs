//! The FP8 recipe a published run trained with, as runs.toml states it: a recipe key
//! (`training.fp8`, `parallel.fp8` or `fp8`, with the spec's names or a framework's own), or
//! the run's free-text `precision` ("amp_fp8", "FP8 (TE, delayed scaling)", "Float8
//! rowwise"). A run that names FP8 without a recipe takes its framework's default: torchao's
//! tensorwise under torchtitan and plain PyTorch (`Float8LinearConfig`'s default recipe),
//! Transformer Engine's delayed scaling elsewhere (Megatron-Core's `fp8_recipe` default
//! "delayed", llm-foundry's `amp_fp8` autocast with TE's `DelayedScaling`).

use toml::Value;

use super::text;
use crate::fp8::Recipe;
use crate::framework::Profile;
use crate::spec::Cluster;

/// The keys a run may state its recipe under, in the order they are read.
pub const FP8_KEYS: [&str; 3] = ["training.fp8", "parallel.fp8", "fp8"];

/// The free-text keys read for FP8 when no recipe key is given.
const PRECISION_KEYS: [&str; 2] = ["precision", "training.precision"];

/// Whether a precision text names FP8 ("fp8", "FP8-CS", "amp_fp8", "Float8").
pub fn names_fp8(text: &str) -> bool {
    let t = text.to_ascii_lowercase();
    t.contains("fp8") || t.contains("float8")
}

/// The recipe a text names, by its words: `Ok(None)` where it names FP8 but no recipe;
/// `Err` for the microscaling and 4-bit formats, which no recipe here models.
fn recipe_in(text: &str) -> Result<Option<Recipe>, String> {
    let t = text.to_ascii_lowercase();
    if let Some(r) = Recipe::by_name(t.trim()) {
        return Ok(Some(r));
    }
    let has = |words: &[&str]| words.iter().any(|w| t.contains(w));
    if has(&["mxfp8", "nvfp4", "fp4", "mx-fp8", "fp8-mx"]) {
        return Err(format!(
            "\"{text}\": microscaling (MXFP8) and 4-bit formats are not modelled (training.fp8: none | tensorwise | rowwise | delayed | blockwise)"
        ));
    }
    Ok(if has(&["rowwise", "row-wise", "axiswise"]) {
        Some(Recipe::Rowwise)
    } else if has(&["blockwise", "block-wise", "128x128", "1x128", "deepseek"]) {
        Some(Recipe::Blockwise)
    } else if has(&[
        "delayed",
        "amp_fp8",
        "hybrid",
        "transformer engine",
        "transformer-engine",
    ]) {
        Some(Recipe::Delayed)
    } else if has(&["tensorwise", "tensor-wise", "current", "fp8-cs", "dynamic"]) {
        Some(Recipe::Tensorwise)
    } else {
        None
    })
}

/// The recipe of a framework's FP8 where the run names none.
fn framework_default(profile: &Profile) -> Recipe {
    if profile.name.starts_with("torchtitan") || profile.name.starts_with("pytorch") {
        Recipe::Tensorwise
    } else {
        Recipe::Delayed
    }
}

/// The run's recipe (`Recipe::None` where it names no FP8); `Err` where two keys disagree, a
/// key names no recipe, or the run's GPU has no FP8 peak in its preset.
pub fn recipe(r: &Value, profile: &Profile, cluster: &Cluster) -> Result<Recipe, String> {
    let mut stated: Option<(&str, Recipe)> = None;
    for key in FP8_KEYS {
        let Some(v) = text(r, key) else { continue };
        let found = match recipe_in(v)? {
            Some(found) => found,
            None if names_fp8(v) => framework_default(profile),
            None => {
                return Err(format!(
                    "`{key}` = \"{v}\" is not an FP8 recipe (none | tensorwise | rowwise | delayed | blockwise)"
                ))
            }
        };
        match stated {
            Some((k0, r0)) if r0 != found => {
                return Err(format!(
                    "`{k0}` = \"{}\" and `{key}` = \"{}\" disagree",
                    r0.name(),
                    found.name()
                ))
            }
            Some(_) => {}
            None => stated = Some((key, found)),
        }
    }
    let recipe = match stated {
        Some((_, r)) => r,
        None => match PRECISION_KEYS
            .iter()
            .find_map(|k| text(r, k).filter(|t| names_fp8(t)))
        {
            Some(t) => recipe_in(t)?.unwrap_or_else(|| framework_default(profile)),
            None => Recipe::None,
        },
    };
    if !recipe.is_none() && cluster.device.peak_tflops_fp8.is_none() {
        return Err(format!(
            "FP8 ({}) on {}, whose preset has no `[device] peak_tflops_fp8`",
            recipe.name(),
            cluster.device.name
        ));
    }
    Ok(recipe)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::framework::by_name;

    fn run(toml_text: &str) -> Value {
        Value::Table(toml_text.parse::<toml::Table>().unwrap())
    }

    fn h100() -> Cluster {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../specs/clusters/dgx-h100-80g.toml");
        crate::spec::load_cluster(&path, Default::default()).unwrap()
    }

    /// Each way a published run says FP8, and the framework's default where it names no
    /// recipe; a planted swap of two recipes' words fails the table.
    #[test]
    fn a_runs_fp8_recipe_from_its_keys_and_its_precision_text() {
        let (titan, mcore) = (
            by_name("torchtitan").unwrap(),
            by_name("megatron-core").unwrap(),
        );
        let c = h100();
        let cases: [(&str, &Profile, Recipe); 10] = [
            ("id = \"a\"", mcore, Recipe::None),
            ("precision = \"amp_bf16\"", mcore, Recipe::None),
            ("precision = \"amp_fp8\"", mcore, Recipe::Delayed),
            ("precision = \"FP8-CS\"", mcore, Recipe::Tensorwise),
            ("precision = \"FP8\"", mcore, Recipe::Delayed),
            ("precision = \"Float8\"", titan, Recipe::Tensorwise),
            ("precision = \"float8 rowwise\"", titan, Recipe::Rowwise),
            ("[training]\nfp8 = \"blockwise\"", mcore, Recipe::Blockwise),
            ("[parallel]\nfp8 = \"delayed\"", titan, Recipe::Delayed),
            (
                "precision = \"bf16\"\n[training]\nfp8 = \"tensorwise\"",
                mcore,
                Recipe::Tensorwise,
            ),
        ];
        for (text, profile, want) in cases {
            assert_eq!(recipe(&run(text), profile, &c), Ok(want), "{text}");
        }
    }

    #[test]
    fn unmodelled_formats_disagreeing_keys_and_gpus_without_fp8_are_refused() {
        let mcore = by_name("megatron-core").unwrap();
        let c = h100();
        for text in [
            "precision = \"MXFP8\"",
            "fp8 = \"tensorwise\"\n[training]\nfp8 = \"rowwise\"",
            "[training]\nfp8 = \"fast\"",
        ] {
            assert!(recipe(&run(text), mcore, &c).is_err(), "{text}");
        }
        let mut a100 = c.clone();
        a100.device.peak_tflops_fp8 = None;
        let e = recipe(&run("precision = \"fp8\""), mcore, &a100).unwrap_err();
        assert!(e.contains("peak_tflops_fp8"), "{e}");
    }
}
