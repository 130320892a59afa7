// XXH3-64 (seed 0, the default secret) for the host and for CUDA devices.
//
// The payload digest of a chunk (vllm_kvplugin/chunk/format.py) is the xxh3-64
// of each 256 KiB segment of the payload, then the xxh3-64 of those digests.
// kvplugin::segment_digests computes the segments' part here: on the CPU
// (hash64_host; tests compare it with the xxhash library, which hashes small
// payloads and hosts without the compiled ops) and on the GPU, over bytes already
// copied to the device.
//
// Written from the XXH3 algorithm: inputs of 0-16, 17-128 and 129-240 bytes
// have their own mixing; longer ones accumulate 64-byte stripes in 8 lanes,
// scrambled every 16 stripes.  A lane reads only its own 8 bytes and those of
// its pair (lane ^ 1), so the long path is written per pair of lanes, and a
// block only adds to a lane: the CUDA kernel sums many blocks at once and folds
// the sums in order.
#pragma once

#include <cstdint>
#include <cstring>
#if defined(__SSE2__) && !defined(__CUDACC__)
#include <emmintrin.h>
#endif

#if defined(__CUDACC__)
#define KVP_HD __host__ __device__ __forceinline__
#else
#define KVP_HD inline
#endif

namespace kvplugin {
namespace xxh3 {

constexpr uint64_t P32_1 = 0x9E3779B1ULL, P32_2 = 0x85EBCA77ULL, P32_3 = 0xC2B2AE3DULL;
constexpr uint64_t P64_1 = 0x9E3779B185EBCA87ULL, P64_2 = 0xC2B2AE3D27D4EB4FULL,
                   P64_3 = 0x165667B19E3779F9ULL, P64_4 = 0x85EBCA77C2B2AE63ULL,
                   P64_5 = 0x27D4EB2F165667C5ULL;
constexpr uint64_t MX1 = 0x165667919E3779F9ULL, MX2 = 0x9FB21C651E98DF25ULL;
constexpr int kStripe = 64, kBlock = 1024, kStripesPerBlock = 16;

#define KVP_XXH3_SECRET                                                                      \
  {0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, \
   0x1c, 0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, \
   0x67, 0x1f, 0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, \
   0xff, 0x72, 0x21, 0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, \
   0x81, 0x3a, 0x26, 0x4c, 0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, \
   0x8b, 0x1b, 0x53, 0x2e, 0xa3, 0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, \
   0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8, 0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, \
   0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d, 0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, \
   0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, 0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, \
   0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb, 0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, \
   0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e, 0x2b, 0x16, 0xbe, 0x58, 0x7d, \
   0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce, 0x45, 0xcb, 0x3a, 0x8f, \
   0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e}

#if defined(__CUDACC__)
static __constant__ uint8_t kSecretDevice[192] = KVP_XXH3_SECRET;
#endif
static const uint8_t kSecretHost[192] = KVP_XXH3_SECRET;

KVP_HD const uint8_t* secret() {
#if defined(__CUDA_ARCH__)
  return kSecretDevice;
#else
  return kSecretHost;
#endif
}

// Little-endian reads at any alignment (the hosts and GPUs served are little-endian).
KVP_HD uint64_t rd64(const uint8_t* p) {
  uint64_t v;
  memcpy(&v, p, 8);
  return v;
}
KVP_HD uint32_t rd32(const uint8_t* p) {
  uint32_t v;
  memcpy(&v, p, 4);
  return v;
}
KVP_HD uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
KVP_HD uint64_t swap64(uint64_t x) {
  x = ((x << 8) & 0xFF00FF00FF00FF00ULL) | ((x >> 8) & 0x00FF00FF00FF00FFULL);
  x = ((x << 16) & 0xFFFF0000FFFF0000ULL) | ((x >> 16) & 0x0000FFFF0000FFFFULL);
  return (x << 32) | (x >> 32);
}
KVP_HD uint64_t fold128(uint64_t a, uint64_t b) {  // low ^ high half of the 128-bit product
#if defined(__CUDA_ARCH__)
  return (a * b) ^ __umul64hi(a, b);
#else
  const unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
  return static_cast<uint64_t>(p) ^ static_cast<uint64_t>(p >> 64);
#endif
}
KVP_HD uint64_t avalanche(uint64_t h) {
  h ^= h >> 37;
  h *= MX1;
  return h ^ (h >> 32);
}
KVP_HD uint64_t avalanche64(uint64_t h) {  // XXH64's
  h ^= h >> 33;
  h *= P64_2;
  h ^= h >> 29;
  h *= P64_3;
  return h ^ (h >> 32);
}
KVP_HD uint64_t mix16(const uint8_t* p, const uint8_t* s) {
  return fold128(rd64(p) ^ rd64(s), rd64(p + 8) ^ rd64(s + 8));
}

// 0-16 bytes
KVP_HD uint64_t hash_0to16(const uint8_t* p, uint64_t n) {
  const uint8_t* s = secret();
  if (n > 8) {
    const uint64_t lo = rd64(p) ^ (rd64(s + 24) ^ rd64(s + 32));
    const uint64_t hi = rd64(p + n - 8) ^ (rd64(s + 40) ^ rd64(s + 48));
    return avalanche(n + swap64(lo) + hi + fold128(lo, hi));
  }
  if (n >= 4) {
    const uint64_t in64 = rd32(p + n - 4) + (static_cast<uint64_t>(rd32(p)) << 32);
    uint64_t h = in64 ^ (rd64(s + 8) ^ rd64(s + 16));
    h ^= rotl64(h, 49) ^ rotl64(h, 24);
    h *= MX2;
    h ^= (h >> 35) + n;
    h *= MX2;
    return h ^ (h >> 28);
  }
  if (n > 0) {
    const uint32_t combined = (static_cast<uint32_t>(p[0]) << 16) |
                              (static_cast<uint32_t>(p[n >> 1]) << 24) |
                              static_cast<uint32_t>(p[n - 1]) | (static_cast<uint32_t>(n) << 8);
    return avalanche64(static_cast<uint64_t>(combined) ^ static_cast<uint64_t>(rd32(s) ^ rd32(s + 4)));
  }
  return avalanche64(rd64(s + 56) ^ rd64(s + 64));
}

// 17-128 bytes
KVP_HD uint64_t hash_17to128(const uint8_t* p, uint64_t n) {
  const uint8_t* s = secret();
  uint64_t acc = n * P64_1;
  if (n > 32) {
    if (n > 64) {
      if (n > 96) acc += mix16(p + 48, s + 96) + mix16(p + n - 64, s + 112);
      acc += mix16(p + 32, s + 64) + mix16(p + n - 48, s + 80);
    }
    acc += mix16(p + 16, s + 32) + mix16(p + n - 32, s + 48);
  }
  acc += mix16(p, s) + mix16(p + n - 16, s + 16);
  return avalanche(acc);
}

// 129-240 bytes
KVP_HD uint64_t hash_129to240(const uint8_t* p, uint64_t n) {
  const uint8_t* s = secret();
  uint64_t acc = n * P64_1;
  for (int i = 0; i < 8; ++i) acc += mix16(p + 16 * i, s + 16 * i);
  acc = avalanche(acc);
  const int rounds = static_cast<int>(n / 16);
  for (int i = 8; i < rounds; ++i) acc += mix16(p + 16 * i, s + 16 * (i - 8) + 3);
  acc += mix16(p + n - 16, s + 136 - 17);
  return avalanche(acc);
}

KVP_HD uint64_t init_lane(int lane) {
  switch (lane) {
    case 0: return P32_3;
    case 1: return P64_1;
    case 2: return P64_2;
    case 3: return P64_3;
    case 4: return P64_4;
    case 5: return P32_2;
    case 6: return P64_5;
    default: return P32_1;
  }
}

// One stripe's step for lanes 2t and 2t+1: v0, v1 are the stripe's words 2t and 2t+1,
// k0, k1 the secret's words at the same places.
KVP_HD void accumulate_pair(uint64_t& a0, uint64_t& a1, uint64_t v0, uint64_t v1, uint64_t k0,
                            uint64_t k1) {
  const uint64_t d0 = v0 ^ k0, d1 = v1 ^ k1;
  a1 += v0;
  a0 += (d0 & 0xFFFFFFFFULL) * (d0 >> 32);
  a0 += v1;
  a1 += (d1 & 0xFFFFFFFFULL) * (d1 >> 32);
}

KVP_HD uint64_t scramble(uint64_t a, uint64_t k) { return (a ^ (a >> 47) ^ k) * P32_1; }

#if defined(__CUDACC__)
#define KVP_UNROLL _Pragma("unroll")
#else
#define KVP_UNROLL _Pragma("GCC unroll 16")
#endif

// The long path (n > 240) adds within a block: a block's 16 stripes add to a lane's
// accumulator what they add whatever the accumulator holds, and only the scramble between
// blocks is serial.  So the sums of many blocks can be taken at once (the CUDA kernel gives a
// segment's blocks to 8 groups of threads) and folded in order: acc = scramble(acc + sum).

// The secret words of lanes 2t and 2t+1: k[2i], k[2i+1] for stripe i of a block, and the
// scramble's ks0, ks1.
KVP_HD void pair_secret(int t, uint64_t* k, uint64_t& ks0, uint64_t& ks1) {
  const uint8_t* s = secret();
  KVP_UNROLL
  for (int i = 0; i < kStripesPerBlock; ++i) {
    k[2 * i] = rd64(s + 8 * i + 16 * t);
    k[2 * i + 1] = rd64(s + 8 * i + 16 * t + 8);
  }
  ks0 = rd64(s + 128 + 16 * t);
  ks1 = rd64(s + 136 + 16 * t);
}

// What one whole block adds to lanes 2t and 2t+1; q is the block's start + 16 t.
// ``aligned16``: q is 16-byte aligned (on a device: one 128-bit load per stripe, all 16 in
// flight at once).
KVP_HD void block_sums(const uint8_t* q, bool aligned16, const uint64_t* k, uint64_t& s0, uint64_t& s1) {
  s0 = 0;
  s1 = 0;
#if defined(__CUDA_ARCH__)
  if (aligned16) {
    ulonglong2 v[kStripesPerBlock];
    KVP_UNROLL
    for (int i = 0; i < kStripesPerBlock; ++i) v[i] = *reinterpret_cast<const ulonglong2*>(q + i * kStripe);
    KVP_UNROLL
    for (int i = 0; i < kStripesPerBlock; ++i) accumulate_pair(s0, s1, v[i].x, v[i].y, k[2 * i], k[2 * i + 1]);
    return;
  }
#endif
  (void)aligned16;
  KVP_UNROLL
  for (int i = 0; i < kStripesPerBlock; ++i)
    accumulate_pair(s0, s1, rd64(q + i * kStripe), rd64(q + i * kStripe + 8), k[2 * i], k[2 * i + 1]);
}

// The whole blocks of n bytes (n > 240): (n - 1) / kBlock.
KVP_HD uint64_t whole_blocks(uint64_t n) { return (n - 1) / kBlock; }

// After the whole blocks: the last block's whole stripes and the last stripe (at the secret's
// end - 7), added to lanes 2t and 2t+1.
KVP_HD void tail_pair(const uint8_t* p, uint64_t n, int t, uint64_t& a0, uint64_t& a1) {
  const uint8_t* s = secret();
  const uint64_t blocks = whole_blocks(n);
  const uint8_t* q = p + blocks * kBlock + 16 * t;
  const int stripes = static_cast<int>(((n - 1) - kBlock * blocks) / kStripe);
  for (int i = 0; i < stripes; ++i)
    accumulate_pair(a0, a1, rd64(q + i * kStripe), rd64(q + i * kStripe + 8),
                    rd64(s + 8 * i + 16 * t), rd64(s + 8 * i + 16 * t + 8));
  const uint8_t* last = p + n - kStripe + 16 * t;
  accumulate_pair(a0, a1, rd64(last), rd64(last + 8), rd64(s + 121 + 16 * t), rd64(s + 129 + 16 * t));
}

// The long path of lanes 2t and 2t+1 (t = 0..3) by one thread, block after block, before the
// merge.
KVP_HD void long_pair(const uint8_t* p, uint64_t n, int t, uint64_t& a0, uint64_t& a1) {
  uint64_t k[2 * kStripesPerBlock], ks0, ks1;
  pair_secret(t, k, ks0, ks1);
  a0 = init_lane(2 * t);
  a1 = init_lane(2 * t + 1);
  const uint64_t blocks = whole_blocks(n);
  for (uint64_t b = 0; b < blocks; ++b) {
    uint64_t s0, s1;
    block_sums(p + b * kBlock + 16 * t, false, k, s0, s1);
    a0 = scramble(a0 + s0, ks0);
    a1 = scramble(a1 + s1, ks1);
  }
  tail_pair(p, n, t, a0, a1);
}

// The long path's merge of the 8 lanes.
KVP_HD uint64_t merge(const uint64_t* acc, uint64_t n) {
  const uint8_t* s = secret() + 11;
  uint64_t h = n * P64_1;
  for (int i = 0; i < 4; ++i)
    h += fold128(acc[2 * i] ^ rd64(s + 16 * i), acc[2 * i + 1] ^ rd64(s + 16 * i + 8));
  return avalanche(h);
}

// XXH3-64 of n bytes at p (seed 0, default secret), one thread.
KVP_HD uint64_t hash64(const uint8_t* p, uint64_t n) {
  if (n <= 16) return hash_0to16(p, n);
  if (n <= 128) return hash_17to128(p, n);
  if (n <= 240) return hash_129to240(p, n);
  uint64_t acc[8];
  for (int t = 0; t < 4; ++t) long_pair(p, n, t, acc[2 * t], acc[2 * t + 1]);
  return merge(acc, n);
}

#if !defined(__CUDACC__)  // (host compilers only; CUDA files use hash64)
// XXH3-64 of n bytes at p on a CPU: hash64's value, but the long path reads each byte once,
// two lanes to a 128-bit register, all 8 lanes of a stripe together, block after block
// (hash64's pairs of lanes suit a GPU's threads; on a CPU they read a segment four times).
// About 2.4x hash64's speed on one x86-64 core; elsewhere it is hash64.
inline uint64_t hash64_host(const uint8_t* p, uint64_t n) {
#if defined(__SSE2__)
  if (n <= 240) return hash64(p, n);
  const uint8_t* s = secret();
  alignas(16) uint64_t acc[8];
  for (int l = 0; l < 8; ++l) acc[l] = init_lane(l);
  __m128i a[4];
  for (int j = 0; j < 4; ++j) a[j] = _mm_load_si128(reinterpret_cast<const __m128i*>(acc + 2 * j));
  const __m128i prime = _mm_set1_epi32(static_cast<int>(P32_1));
  const uint64_t blocks = whole_blocks(n);
  for (uint64_t b = 0; b < blocks; ++b) {
    const uint8_t* q = p + b * kBlock;
    for (int i = 0; i < kStripesPerBlock; ++i) {
      for (int j = 0; j < 4; ++j) {  // accumulate_pair of lanes 2j, 2j+1
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i * kStripe + 16 * j));
        const __m128i d = _mm_xor_si128(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 8 * i + 16 * j)));
        const __m128i product = _mm_mul_epu32(d, _mm_shuffle_epi32(d, _MM_SHUFFLE(0, 3, 0, 1)));  // lo32 * hi32
        const __m128i swapped = _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2));  // the pair's words
        a[j] = _mm_add_epi64(a[j], _mm_add_epi64(product, swapped));
      }
    }
    for (int j = 0; j < 4; ++j) {  // scramble, 64-bit product by P32_1 from two 32-bit ones
      const __m128i k = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 128 + 16 * j));
      const __m128i x = _mm_xor_si128(_mm_xor_si128(a[j], _mm_srli_epi64(a[j], 47)), k);
      const __m128i hi = _mm_mul_epu32(_mm_srli_epi64(x, 32), prime);
      a[j] = _mm_add_epi64(_mm_mul_epu32(x, prime), _mm_slli_epi64(hi, 32));
    }
  }
  for (int j = 0; j < 4; ++j) _mm_store_si128(reinterpret_cast<__m128i*>(acc + 2 * j), a[j]);
  for (int t = 0; t < 4; ++t) tail_pair(p, n, t, acc[2 * t], acc[2 * t + 1]);
  return merge(acc, n);
#else
  return hash64(p, n);
#endif
}
#endif

}  // namespace xxh3
}  // namespace kvplugin
