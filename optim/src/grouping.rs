//! Grouping of items by the device they live on, shared by every per-device dispatch (the
//! optimizers' steps and `zero_grad`). A module of its own so that `optimizer` and `zero_grad`
//! both depend on it and not on each other.

use tandem_core::Device;

/// `items` grouped by device, in order of first appearance; within a group in their order.
/// Training keeps everything on one device, which costs one pass and no search.
pub(crate) fn by_device<T>(items: &[T], device: impl Fn(&T) -> Device) -> Vec<(Device, Vec<&T>)> {
    let Some(first) = items.first().map(&device) else {
        return Vec::new();
    };
    if items.iter().all(|item| device(item) == first) {
        return vec![(first, items.iter().collect())];
    }
    let mut groups: Vec<(Device, Vec<&T>)> = Vec::new();
    for item in items {
        let d = device(item);
        match groups.iter_mut().find(|(g, _)| *g == d) {
            Some((_, group)) => group.push(item),
            None => {
                let mut group = Vec::with_capacity(items.len());
                group.push(item);
                groups.push((d, group));
            }
        }
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_are_grouped_by_device_in_order() {
        let items = [
            (Device::Cpu, 0),
            (Device::Cuda(1), 1),
            (Device::Cpu, 2),
            (Device::Cuda(0), 3),
        ];
        let groups = by_device(&items, |i| i.0);
        let flat: Vec<(Device, Vec<i32>)> = groups
            .into_iter()
            .map(|(d, g)| (d, g.into_iter().map(|i| i.1).collect()))
            .collect();
        assert_eq!(
            flat,
            [
                (Device::Cpu, vec![0, 2]),
                (Device::Cuda(1), vec![1]),
                (Device::Cuda(0), vec![3])
            ]
        );
        let one = [(Device::Cpu, 0), (Device::Cpu, 1)];
        let groups = by_device(&one, |i| i.0);
        assert_eq!(groups.len(), 1);
        assert_eq!(groups[0].1.len(), 2);
        assert!(by_device(&[] as &[(Device, i32)], |i| i.0).is_empty());
    }
}
