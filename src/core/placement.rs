//! Where a queue lives: which core owns it, and which nodes store a replicated queue. Pure
//! functions; what they choose is recorded in the metadata at declare time.

/// FNV-1a over `vhost \0 name`, then over `salt`'s bytes (little-endian) when given.
fn fnv(vhost: &str, name: &str, salt: Option<u64>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let salt = salt.map(u64::to_le_bytes);
    for b in vhost.bytes().chain(std::iter::once(0)).chain(name.bytes()).chain(salt.iter().flatten().copied()) {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Owner core of queue `name` in `vhost` among `cores` cores: FNV-1a over
/// `vhost \0 name`, modulo `cores`. Stable across runs and platforms.
pub fn owner_core(vhost: &str, name: &str, cores: u32) -> u32 {
    (fnv(vhost, name, None) % cores.max(1) as u64) as u32
}

/// Owner core of a queue declared by a connection served by core `local` (RabbitMQ's
/// `client-local` queue leader locator, applied to the cores of a node): `local`, so that
/// a connection's own queue (a consumer's, an RPC reply queue) never makes its deliveries
/// cross cores; but when `local` already owns more queues than the least loaded core by
/// more than the slack (16 queues, or a quarter of the average per core if that is more),
/// the least loaded core (the lowest index on a tie), so that one connection declaring a
/// whole topology still spreads it. `owned[c]` is how many queues core `c` owns now; a
/// `local` outside `owned` is taken modulo its length.
pub fn local_core(local: u32, owned: &[usize]) -> u32 {
    let cores = owned.len().max(1);
    let local = local as usize % cores;
    let Some((least, &min)) = owned.iter().enumerate().min_by_key(|&(c, &n)| (n, c)) else { return 0 };
    let slack = 16usize.max(owned.iter().sum::<usize>() / cores / 4);
    if owned[local] > min + slack {
        least as u32
    } else {
        local as u32
    }
}

/// The replica set (node ids) of a replicated queue declared on node `owner`: `size` nodes of `members`
/// (capped at how many there are; at least the owner), ascending. The owner is always in it;
/// the others are the members that store the fewest queues now (`stored(node)`: how many
/// replica sets name it), ties broken by a hash of the queue name and the node id, so
/// queues spread over the cluster (RabbitMQ's quorum queues place members the same way:
/// the least loaded first).
pub fn replica_set(vhost: &str, name: &str, owner: u64, members: &[u64], size: usize, stored: impl Fn(u64) -> usize) -> Vec<u64> {
    let mut others: Vec<u64> = members.iter().copied().filter(|&m| m != owner).collect();
    others.sort_unstable();
    others.dedup();
    others.sort_by_key(|&m| (stored(m), fnv(vhost, name, Some(m))));
    let mut set: Vec<u64> = std::iter::once(owner).chain(others.into_iter().take(size.saturating_sub(1))).collect();
    set.sort_unstable();
    set
}

/// The node a replica set grows to (`meta::grow`): of `candidates` (live voters outside the
/// set), the one storing the fewest queues, ties broken by the same hash as
/// [`replica_set`]; `None` when there is none.
pub fn grow_target(vhost: &str, name: &str, candidates: &[u64], stored: impl Fn(u64) -> usize) -> Option<u64> {
    candidates.iter().copied().min_by_key(|&m| (stored(m), fnv(vhost, name, Some(m))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn in_range_and_stable(v in ".{0,8}", n in ".{0,16}", cores in 1u32..64) {
            let c = owner_core(&v, &n, cores);
            prop_assert!(c < cores);
            prop_assert_eq!(c, owner_core(&v, &n, cores));
        }
    }

    proptest! {
        #[test]
        fn local_core_stays_local_until_the_cores_drift_apart(cores in 1usize..9, local in 0u32..16, declares in 0usize..3000) {
            // One connection declaring everything: the cores stay within the slack.
            let mut owned = vec![0usize; cores];
            for _ in 0..declares {
                let c = local_core(local, &owned) as usize;
                prop_assert!(c < cores);
                owned[c] += 1;
                let (max, min) = (*owned.iter().max().unwrap(), *owned.iter().min().unwrap());
                prop_assert!(max - min <= 17usize.max(owned.iter().sum::<usize>() / cores / 4 + 1), "{owned:?}");
            }
            // Balanced cores: the declaring connection's own.
            let even = vec![5usize; cores];
            prop_assert_eq!(local_core(local, &even), local % cores as u32);
        }
    }

    proptest! {
        #[test]
        fn a_replica_set_holds_the_owner_and_only_members(owner in 1u64..6, extra in proptest::collection::btree_set(1u64..9, 0..7), size in 1usize..9) {
            let members: Vec<u64> = extra.iter().copied().chain([owner]).collect();
            let set = replica_set("/", "q", owner, &members, size, |_| 0);
            let distinct = extra.iter().chain([&owner]).collect::<std::collections::BTreeSet<_>>().len();
            prop_assert_eq!(set.len(), size.min(distinct));
            prop_assert!(set.contains(&owner));
            prop_assert!(set.windows(2).all(|w| w[0] < w[1]));
            prop_assert!(set.iter().all(|m| members.contains(m)));
        }
    }

    #[test]
    fn a_set_grows_to_the_least_loaded_candidate() {
        assert_eq!(grow_target("/", "q", &[], |_| 0), None);
        assert_eq!(grow_target("/", "q", &[4, 5, 6], |n| if n == 5 { 0 } else { 3 }), Some(5));
        // Equal load: the choice follows the queue name, and every candidate gets some.
        let picks: std::collections::BTreeSet<u64> =
            (0..200).filter_map(|i| grow_target("/", &format!("q{i}"), &[4, 5, 6], |_| 0)).collect();
        assert_eq!(picks.into_iter().collect::<Vec<_>>(), vec![4, 5, 6]);
    }

    #[test]
    fn replica_sets_go_to_the_least_loaded_nodes_and_spread() {
        let members = [1, 2, 3, 4, 5];
        // Node 2 and 3 store many queues already: a set of 3 declared on 1 takes 4 and 5.
        let load = |n: u64| if n == 2 || n == 3 { 10 } else { 0 };
        assert_eq!(replica_set("/", "q", 1, &members, 3, load), vec![1, 4, 5]);
        // Equal load: the hash spreads the sets over every node.
        let mut seen = [0u32; 6];
        for i in 0..500 {
            for n in replica_set("/", &format!("q{i}"), 1, &members, 3, |_| 0) {
                seen[n as usize] += 1;
            }
        }
        assert_eq!(seen[1], 500);
        assert!(seen[2..].iter().all(|&n| n > 150), "{seen:?}");
    }

    #[test]
    fn spreads() {
        let mut seen = [0u32; 4];
        for i in 0..400 {
            seen[owner_core("/", &format!("q{i}"), 4) as usize] += 1;
        }
        assert!(seen.iter().all(|&n| n > 50), "{seen:?}");
    }
}
