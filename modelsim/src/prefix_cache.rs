//! modelsim's prefix cache, kept as vLLM's automatic prefix caching keeps its KV blocks: a
//! prompt's tokens in blocks of [`BLOCK_TOKENS`], each block known by a hash chained over the
//! whole prefix up to its end (the same block text after another prefix is another block), only
//! full blocks cached, at most a capacity of blocks held, the least recently used evicted first.
//!
//! A prompt is served from the cache up to its longest run of cached blocks from the start, and
//! never in whole: as vLLM does, at least its last token is computed again (the model needs it
//! to produce the first output token), so a prompt of exactly `k` full blocks, all cached, hits
//! `k − 1` of them. A request's blocks enter the cache once its prefill is done
//! ([`PrefixCache::insert`]); two identical prompts prefilled at once both miss, as in vLLM.
//!
//! modelsim's tokens are its count's: the prompt's text (the messages' contents in order, or
//! `prompt`) in groups of 4 characters, so a block is 64 characters. The text of each message is
//! hashed with its role and the start of a message, as a chat template frames it, and the first
//! block with the model's name, without counting either as tokens. Output tokens are not cached:
//! modelsim's output words are not its prompt tokens, so an assistant turn echoed back in the
//! next prompt is prompt text like any other.
//!
//! Eviction order follows vLLM's free block queue: a request's blocks are used from the last to
//! the first, so that of one prompt its tail goes first and its shared prefix stays longest.

use std::collections::{BTreeMap, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};

/// Tokens a block holds (vLLM's default `--block-size`).
pub const BLOCK_TOKENS: u32 = 16;

/// Characters a token is, modelsim's count of prompt tokens (characters ÷ 4, rounded up).
pub const CHARS_PER_TOKEN: u32 = 4;

/// The chained hashes of a prompt's full blocks, built as its text is read.
#[derive(Debug)]
pub(crate) struct BlockHasher {
    hasher: DefaultHasher,
    /// Characters in the block being read.
    chars: u32,
    blocks: Vec<u64>,
}

impl BlockHasher {
    /// The hasher of a prompt to `model`.
    pub fn new(model: &str) -> Self {
        let mut hasher = DefaultHasher::new();
        "model".hash(&mut hasher);
        model.hash(&mut hasher);
        Self {
            hasher,
            chars: 0,
            blocks: Vec::new(),
        }
    }

    /// A message (or a prompt) starts, with its `role` if it has one: framing, hashed into the
    /// block it falls in, not counted.
    pub fn start(&mut self, role: Option<&str>) {
        0xfe_u8.hash(&mut self.hasher);
        role.hash(&mut self.hasher);
    }

    /// More of the prompt's text.
    pub fn text(&mut self, text: &str) {
        const BLOCK_CHARS: u32 = BLOCK_TOKENS * CHARS_PER_TOKEN;
        for c in text.chars() {
            c.hash(&mut self.hasher);
            self.chars += 1;
            if self.chars == BLOCK_CHARS {
                let block = self.hasher.finish();
                self.blocks.push(block);
                // The next block's hash starts from this one: chained over the prefix.
                self.hasher = DefaultHasher::new();
                block.hash(&mut self.hasher);
                self.chars = 0;
            }
        }
    }

    /// The hashes of the full blocks read (a last partial block is not cached).
    pub fn finish(self) -> Vec<u64> {
        self.blocks
    }
}

/// A bounded LRU set of block hashes.
#[derive(Debug)]
pub(crate) struct PrefixCache {
    capacity: usize,
    /// Each cached block with its last use.
    blocks: HashMap<u64, u64>,
    /// The same, by last use: the least recently used first.
    by_use: BTreeMap<u64, u64>,
    clock: u64,
}

impl PrefixCache {
    /// A cache of at most `capacity` blocks; 0 turns it off.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            blocks: HashMap::new(),
            by_use: BTreeMap::new(),
            clock: 0,
        }
    }

    /// Whether it caches anything.
    pub fn enabled(&self) -> bool {
        self.capacity > 0
    }

    /// The prompt tokens of a prompt of `prompt_tokens` tokens whose full blocks are `blocks`
    /// that are served from the cache: its longest run of cached blocks from the start, short
    /// of its last token. The blocks hit count as used now.
    pub fn lookup(&mut self, blocks: &[u64], prompt_tokens: u32) -> u32 {
        if !self.enabled() {
            return 0;
        }
        let most = (prompt_tokens.saturating_sub(1) / BLOCK_TOKENS) as usize;
        let hit = blocks
            .iter()
            .take(most)
            .take_while(|b| self.blocks.contains_key(b))
            .count();
        for block in blocks[..hit].iter().rev() {
            self.touch(*block);
        }
        u32::try_from(hit).unwrap_or(u32::MAX) * BLOCK_TOKENS
    }

    /// Caches a prefilled prompt's full blocks (those cached already count as used now),
    /// evicting the least recently used beyond the capacity.
    pub fn insert(&mut self, blocks: &[u64]) {
        if !self.enabled() {
            return;
        }
        for block in blocks.iter().rev() {
            self.touch(*block);
        }
        while self.blocks.len() > self.capacity {
            let Some((_, oldest)) = self.by_use.pop_first() else {
                break;
            };
            self.blocks.remove(&oldest);
        }
    }

    /// Blocks held.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    fn touch(&mut self, block: u64) {
        self.clock += 1;
        if let Some(used) = self.blocks.insert(block, self.clock) {
            self.by_use.remove(&used);
        }
        self.by_use.insert(self.clock, block);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The block hashes of a single-message chat prompt `text` to model `m`.
    fn blocks(text: &str) -> Vec<u64> {
        let mut h = BlockHasher::new("m");
        h.start(Some("user"));
        h.text(text);
        h.finish()
    }

    /// `n` characters of text made from `seed`, distinct for distinct seeds.
    fn text(seed: &str, n: usize) -> String {
        seed.chars().cycle().take(n).collect()
    }

    fn tokens(text: &str) -> u32 {
        (text.chars().count() as u32).div_ceil(CHARS_PER_TOKEN)
    }

    #[test]
    fn only_full_blocks_are_hashed_each_chained_over_its_prefix() {
        assert_eq!(blocks(&text("a", 63)).len(), 0);
        assert_eq!(blocks(&text("a", 64)).len(), 1);
        assert_eq!(blocks(&text("a", 200)).len(), 3);
        // The same second block after another first one is another block.
        let one = blocks(&format!("{}{}", text("a", 64), text("b", 64)));
        let two = blocks(&format!("{}{}", text("c", 64), text("b", 64)));
        assert_ne!(one[1], two[1]);
        // The role and the model frame the text.
        let mut system = BlockHasher::new("m");
        system.start(Some("system"));
        system.text(&text("a", 64));
        assert_ne!(system.finish(), blocks(&text("a", 64)));
        let mut other_model = BlockHasher::new("n");
        other_model.start(Some("user"));
        other_model.text(&text("a", 64));
        assert_ne!(other_model.finish(), blocks(&text("a", 64)));
        // Text split over frames of any size hashes the same.
        let mut parts = BlockHasher::new("m");
        parts.start(Some("user"));
        let whole = text("xyz", 150);
        let (a, b) = whole.split_at(37);
        parts.text(a);
        parts.text(b);
        assert_eq!(parts.finish(), blocks(&whole));
    }

    #[test]
    fn a_shared_prefix_hits_at_block_granularity() {
        let mut cache = PrefixCache::new(100);
        let system = text("You are a careful assistant. ", 100);
        let first = format!("{system}{}", text("first question? ", 90));
        let second = format!("{system}{}", text("second question! ", 90));
        let (b1, b2) = (blocks(&first), blocks(&second));
        assert_eq!(cache.lookup(&b1, tokens(&first)), 0, "a cold cache");
        cache.insert(&b1);
        // 100 shared characters: the first block (64 characters, 16 tokens) is shared, the
        // second differs from its 37th character on.
        assert_eq!(cache.lookup(&b2, tokens(&second)), BLOCK_TOKENS);
        // The same prompt again: every full block.
        assert_eq!(cache.lookup(&b1, tokens(&first)), 2 * BLOCK_TOKENS);
    }

    #[test]
    fn the_last_token_of_a_prompt_is_never_served_from_the_cache() {
        let mut cache = PrefixCache::new(100);
        let exact = text("exactly two blocks ", 128);
        let b = blocks(&exact);
        assert_eq!(b.len(), 2);
        cache.insert(&b);
        assert_eq!(
            cache.lookup(&b, tokens(&exact)),
            BLOCK_TOKENS,
            "32 tokens, all cached: 31 at most, one block"
        );
        let longer = format!("{exact}!");
        assert_eq!(cache.lookup(&blocks(&longer), tokens(&longer)), 32);
    }

    #[test]
    fn the_least_recently_used_blocks_are_evicted_a_prompts_tail_first() {
        let mut cache = PrefixCache::new(4);
        // A character past the full blocks: every block may be served from the cache.
        let a = text("alpha ", 64 * 3 + 1);
        let b = text("beta ", 64 * 2 + 1);
        let (ba, bb) = (blocks(&a), blocks(&b));
        cache.insert(&ba);
        cache.insert(&bb);
        assert_eq!(cache.len(), 4, "bounded");
        // a's tail went first: its first two blocks stay.
        assert_eq!(cache.lookup(&ba, tokens(&a)), 2 * BLOCK_TOKENS);
        assert_eq!(cache.lookup(&bb, tokens(&b)), 2 * BLOCK_TOKENS);
        // Used last, b stays whole while c evicts what a left.
        let c = text("gamma ", 64 * 2);
        cache.insert(&blocks(&c));
        assert_eq!(cache.lookup(&ba, tokens(&a)), 0);
        assert_eq!(cache.lookup(&bb, tokens(&b)), 2 * BLOCK_TOKENS);
    }

    #[test]
    fn a_capacity_of_zero_caches_nothing() {
        let mut cache = PrefixCache::new(0);
        let a = text("alpha ", 64 * 3);
        cache.insert(&blocks(&a));
        assert!(!cache.enabled());
        assert_eq!(cache.len(), 0);
        assert_eq!(cache.lookup(&blocks(&a), tokens(&a)), 0);
    }
}
