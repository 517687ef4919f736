//! The precision a device runs: kept out of the policy table so the spec readers, which name
//! the policies, need not import the resolved model and cluster this reads.

/// The model as it runs on `cluster`: a device that states its precision policy (the CPU
/// backend's `fp32`) runs only that one, so it replaces the model spec's `training.precision`;
/// otherwise the model as it is.
pub fn for_device<'a>(
    model: &'a crate::model::Model,
    cluster: &crate::spec::Cluster,
) -> std::borrow::Cow<'a, crate::model::Model> {
    match &cluster.device.precision {
        Some(p) if *p != model.training.precision => {
            let mut m = model.clone();
            m.training.precision = p.clone();
            std::borrow::Cow::Owned(m)
        }
        _ => std::borrow::Cow::Borrowed(model),
    }
}
