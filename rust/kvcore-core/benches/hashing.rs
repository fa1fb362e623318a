//! Criterion micro-benchmarks of block hashing: one block, and a 4096-token prompt in 16-token
//! windows, for each of the four functions.

#![allow(missing_docs)]

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvcore_core::hashing::{BlockHasher, HashFn};
use kvcore_core::value::Value;

fn tokens(n: usize) -> Vec<i64> {
    // Deterministic token ids spread over the int32 range (LCG).
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            ((x >> 33) % 2_147_483_647) as i64
        })
        .collect()
}

fn bench_hashing(c: &mut Criterion) {
    let prompt = tokens(4096);
    let mut group = c.benchmark_group("hashing");
    for f in HashFn::ALL {
        let none_hash = f.hash_value(&Value::Str("0".into())).unwrap();
        let mut hasher = BlockHasher::new(f, none_hash.as_bytes());
        group.throughput(Throughput::Elements(1));
        group.bench_with_input(BenchmarkId::new("block16", f.name()), &prompt, |b, p| {
            b.iter(|| hasher.hash_block(None, black_box(&p[..16]), None).unwrap())
        });
        let extra = vec![
            Value::Str("lora-a".into()),
            Value::Tuple(vec![Value::Str("img-abc".into()), Value::Int(3)]),
            Value::Str("salt-1".into()),
        ];
        group.bench_with_input(
            BenchmarkId::new("block16_extra", f.name()),
            &prompt,
            |b, p| {
                b.iter(|| {
                    hasher
                        .hash_block(None, black_box(&p[..16]), Some(&extra))
                        .unwrap()
                })
            },
        );
        group.throughput(Throughput::Elements(256));
        group.bench_with_input(BenchmarkId::new("prompt4096", f.name()), &prompt, |b, p| {
            b.iter(|| hasher.hash_blocks(None, black_box(p), 16, None).unwrap())
        });
    }
    group.finish();
}

criterion_group!(benches, bench_hashing);
criterion_main!(benches);
