//! Tests of the cache-control extensions (retention, pins, invalidation, router-exact events).

use super::retention::Retention;
use super::*;
use crate::events::MetaRequest;

fn h(x: u8) -> BlockHash {
    BlockHash::from_slice(&[x; 32]).unwrap()
}

fn pool(n: i64) -> BlockPool {
    BlockPool::new(n, true, 16, true).unwrap()
}

/// Caches `blocks` (all new) under `hashes` in group 0.
fn cache(p: &mut BlockPool, blocks: &[u32], hashes: &[BlockHash]) {
    let mut get = |i: usize| -> Result<BlockHash, PoolError> { Ok(hashes[i]) };
    p.cache_full_blocks(
        blocks,
        0,
        blocks.len(),
        16,
        0,
        None,
        HashSource {
            len: &mut || Ok(hashes.len()),
            get: &mut get,
        },
        &mut |_: &MetaRequest<'_>| Ok(StoredMeta::default()),
    )
    .unwrap();
}

/// Allocates and caches one block per hash, then frees them with `r` at `now`.
fn cached_free(p: &mut BlockPool, hashes: &[BlockHash], r: Retention, now: f64) -> Vec<u32> {
    let blocks = p.get_new_blocks(hashes.len()).unwrap();
    cache(p, &blocks, hashes);
    p.free_blocks_retained(blocks.iter().rev().copied(), r, now)
        .unwrap();
    blocks
}

#[test]
fn retention_validates() {
    assert!(Retention::new(-1, None).is_err());
    assert!(Retention::new(101, None).is_err());
    assert!(Retention::new(50, Some(f64::NAN)).is_err());
    assert!(Retention::new(50, Some(-1.0)).is_err());
    assert!(Retention::new(50, Some(f64::INFINITY)).is_err());
    assert!(Retention::new(0, Some(0.0)).is_ok());
    assert!(Retention::new(50, None).unwrap().is_default());
}

#[test]
fn default_retention_is_the_reference_queue() {
    let mut a = pool(8);
    let mut b = pool(8);
    let blocks = a.get_new_blocks(3).unwrap();
    b.get_new_blocks(3).unwrap();
    cache(&mut a, &blocks[..2], &[h(1), h(2)]);
    cache(&mut b, &blocks[..2], &[h(1), h(2)]);
    a.free_blocks(&[3, 2, 1]).unwrap();
    b.free_blocks_retained([3u32, 2, 1], Retention::DEFAULT, 7.0)
        .unwrap();
    assert_eq!(a.all_free_block_ids(), b.all_free_block_ids());
    assert_eq!(a.all_free_block_ids(), vec![3, 4, 5, 6, 7, 2, 1]);
    b.check_invariants().unwrap();
}

#[test]
fn lower_priority_is_evicted_first_lru_within() {
    let mut p = pool(8);
    let low = cached_free(
        &mut p,
        &[h(1), h(2)],
        Retention::new(10, None).unwrap(),
        0.0,
    );
    let high = cached_free(
        &mut p,
        &[h(3), h(4)],
        Retention::new(90, None).unwrap(),
        0.0,
    );
    let mid = cached_free(&mut p, &[h(5)], Retention::DEFAULT, 0.0);
    p.check_invariants().unwrap();
    // Two never-used blocks first, then priority 10 (tail block first), 50, 90.
    let order = p.all_free_block_ids();
    assert_eq!(order.len(), 7);
    assert_eq!(&order[2..], &[low[1], low[0], mid[0], high[1], high[0]]);
    let taken = p.get_new_blocks(4).unwrap();
    assert_eq!(&taken[2..], &[low[1], low[0]]);
    assert!(p.get_one_block(&BlockKey::new(h(3), 0)).is_some());
    assert!(p.get_one_block(&BlockKey::new(h(1), 0)).is_none());
    p.check_invariants().unwrap();
}

#[test]
fn ttl_expiry_moves_blocks_to_the_front() {
    let mut p = pool(6);
    let kept = cached_free(
        &mut p,
        &[h(1)],
        Retention::new(90, Some(5.0)).unwrap(),
        100.0,
    );
    let plain = cached_free(&mut p, &[h(2)], Retention::DEFAULT, 100.0);
    p.get_new_blocks(3).unwrap(); // the never-used blocks
    assert!(!p.needs_expire(104.9));
    p.expire(104.9);
    assert_eq!(p.all_free_block_ids(), vec![plain[0], kept[0]]);
    assert!(p.needs_expire(105.0));
    p.expire(105.0);
    assert_eq!(p.all_free_block_ids(), vec![kept[0], plain[0]]);
    assert_eq!(p.next_expiry(), f64::INFINITY);
    p.check_invariants().unwrap();
}

#[test]
fn a_block_taken_again_loses_its_deadline() {
    let mut p = pool(4);
    let b = cached_free(&mut p, &[h(1)], Retention::new(90, Some(1.0)).unwrap(), 0.0);
    p.touch(&b).unwrap();
    p.free_blocks_retained(b.iter().copied(), Retention::new(90, None).unwrap(), 0.5)
        .unwrap();
    p.expire(10.0);
    assert_eq!(p.all_free_block_ids().last(), Some(&b[0]));
    p.check_invariants().unwrap();
}

#[test]
fn pins_hold_blocks_and_count_as_used() {
    let mut p = pool(6);
    let b = cached_free(&mut p, &[h(1), h(2), h(3)], Retention::DEFAULT, 0.0);
    let counts = p
        .pin_prefix(&[(0, &[h(1), h(2), h(9), h(3)])], None, 0.0, 5)
        .unwrap();
    assert_eq!(counts, vec![2]);
    assert_eq!(p.num_pinned_blocks(), 2);
    assert_eq!(p.get_num_free_blocks(), 3);
    assert!(p.get_new_blocks(4).is_err());
    let taken = p.get_new_blocks(3).unwrap();
    assert!(!taken.contains(&b[0]) && !taken.contains(&b[1]));
    assert!(p.get_one_block(&BlockKey::new(h(1), 0)).is_some());
    p.check_invariants().unwrap();
    assert_eq!(p.unpin_prefix(&[(0, &[h(1), h(2)])]), vec![2]);
    assert_eq!(p.num_pinned_blocks(), 0);
    assert_eq!(p.get_num_free_blocks(), 2);
    p.check_invariants().unwrap();
}

#[test]
fn pin_bound_pins_nothing() {
    let mut p = pool(6);
    cached_free(&mut p, &[h(1), h(2), h(3)], Retention::DEFAULT, 0.0);
    let before = p.all_free_block_ids();
    assert!(matches!(
        p.pin_prefix(&[(0, &[h(1), h(2), h(3)])], None, 0.0, 2),
        Err(PoolError::PinLimit { requested: 3, .. })
    ));
    assert_eq!(p.num_pinned_blocks(), 0);
    assert_eq!(p.all_free_block_ids(), before);
}

#[test]
fn pin_expiry_releases() {
    let mut p = pool(4);
    cached_free(&mut p, &[h(1)], Retention::DEFAULT, 0.0);
    p.pin_prefix(&[(0, &[h(1)])], Some(3.0), 0.0, 3).unwrap();
    p.expire(2.0);
    assert_eq!(p.num_pinned_blocks(), 1);
    p.expire(3.0);
    assert_eq!(p.num_pinned_blocks(), 0);
    assert_eq!(p.get_num_free_blocks(), 3);
    p.check_invariants().unwrap();
}

#[test]
fn reset_releases_pins_when_only_they_hold_blocks() {
    let mut p = pool(5);
    cached_free(&mut p, &[h(1)], Retention::DEFAULT, 0.0);
    p.pin_prefix(&[(0, &[h(1)])], None, 0.0, 3).unwrap();
    let held = p.get_new_blocks(1).unwrap();
    assert!(!p.reset_prefix_cache());
    assert_eq!(p.num_pinned_blocks(), 1);
    p.free_blocks(&held).unwrap();
    assert!(p.reset_prefix_cache());
    assert_eq!(p.num_pinned_blocks(), 0);
    assert_eq!(p.get_num_free_blocks(), 4);
    p.check_invariants().unwrap();
}

#[test]
fn invalidate_while_blocks_are_held() {
    let mut p = pool(6);
    let held = p.get_new_blocks(2).unwrap();
    cache(&mut p, &held, &[h(1), h(2)]);
    cached_free(&mut p, &[h(3)], Retention::DEFAULT, 0.0);
    p.take_events();
    p.invalidate_prefix_cache();
    assert_eq!(p.take_events(), vec![KvEvent::AllBlocksCleared]);
    assert!(p.get_one_block(&BlockKey::new(h(1), 0)).is_none());
    assert!(p.get_one_block(&BlockKey::new(h(3), 0)).is_none());
    assert_eq!(p.ref_cnt(held[0]), 1);
    p.check_invariants().unwrap();
    p.free_blocks(&held).unwrap();
    assert_eq!(p.get_num_free_blocks(), 5);
    p.check_invariants().unwrap();
}

#[test]
fn exact_events_name_first_and_last_copies() {
    let mut p = pool(8);
    p.set_exact_router_events(true);
    let a = p.get_new_blocks(2).unwrap();
    cache(&mut p, &a, &[h(1), h(2)]);
    let b = p.get_new_blocks(3).unwrap();
    cache(&mut p, &b, &[h(1), h(2), h(3)]);
    let events = p.take_events();
    let stored: Vec<(Vec<BlockHash>, Option<BlockHash>)> = events
        .iter()
        .map(|e| match e {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                ..
            } => (block_hashes.clone(), *parent_block_hash),
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(
        stored,
        vec![(vec![h(1), h(2)], None), (vec![h(3)], Some(h(2)))]
    );
    // Evicting the first copy of h(1) says nothing; the last one says BlockRemoved.
    p.free_blocks(&[a[1], a[0]]).unwrap();
    p.evict_blocks(&[i64::from(a[0])]).unwrap();
    assert!(p.take_events().is_empty());
    p.evict_blocks(&[i64::from(b[0])]).unwrap();
    assert_eq!(
        p.take_events(),
        vec![KvEvent::BlockRemoved {
            block_hash: h(1),
            group_idx: 0
        }]
    );
}

#[test]
fn earliest_deadline_expires_first_across_ttls() {
    let mut p = pool(8);
    let a = cached_free(
        &mut p,
        &[h(1)],
        Retention::new(100, Some(10.0)).unwrap(),
        0.0,
    );
    let b = cached_free(&mut p, &[h(2)], Retention::new(90, Some(3.0)).unwrap(), 2.0);
    p.get_new_blocks(5).unwrap(); // the never-used blocks
    p.expire(20.0);
    assert_eq!(p.all_free_block_ids(), vec![b[0], a[0]]);
    p.check_invariants().unwrap();
}
