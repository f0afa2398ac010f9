//! Prefill planning: pack several prompts into as few `llama_decode` batches
//! as possible, splitting prompts across batch boundaries where needed.

/// A run of `len` tokens of prompt `item`, starting at token `start` of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// Index of the prompt in the planned list.
    pub item: usize,
    /// First token of the prompt this span covers.
    pub start: usize,
    /// Tokens in the span.
    pub len: usize,
    /// This span ends the item, so its last token is the one whose logits we need.
    pub is_last: bool,
}

/// One batch worth of spans, in stream order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Chunk {
    /// The spans, at most one batch of tokens in all.
    pub spans: Vec<Span>,
}

impl Chunk {
    /// Tokens in this chunk (at most the `n_batch` it was planned with).
    pub fn n_tokens(&self) -> usize {
        self.spans.iter().map(|s| s.len).sum()
    }
}

/// Concatenates items of the given lengths and cuts the stream every
/// `n_batch` tokens, giving exactly `ceil(total / n_batch)` chunks, every one
/// full except possibly the last. Empty items produce no spans.
///
/// # Panics
/// If `n_batch == 0`.
pub fn plan_prefill(lens: &[usize], n_batch: usize) -> Vec<Chunk> {
    assert!(n_batch > 0, "n_batch must be positive");
    let mut chunks = Vec::new();
    let mut current = Chunk::default();
    let mut room = n_batch;
    for (item, &len) in lens.iter().enumerate() {
        let mut start = 0;
        while start < len {
            let take = (len - start).min(room);
            current.spans.push(Span {
                item,
                start,
                len: take,
                is_last: start + take == len,
            });
            start += take;
            room -= take;
            if room == 0 {
                chunks.push(std::mem::take(&mut current));
                room = n_batch;
            }
        }
    }
    if !current.spans.is_empty() {
        chunks.push(current);
    }
    chunks
}

/// Where a prompt of a continuous prefill stands: `done` of its `len` tokens decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    /// Tokens decoded already.
    pub done: usize,
    /// Tokens in all.
    pub len: usize,
}

/// What one decode of a continuous prefill may hold: `tokens` prompt tokens (a batch less
/// the running streams' tokens riding along), `outputs` logits rows (prompts it may finish:
/// llama.cpp reserves `n_seq_max` rows and moves its buffer for more) and `spans` spans.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkRoom {
    /// Prompt tokens.
    pub tokens: usize,
    /// Prompts it may finish.
    pub outputs: usize,
    /// Spans (sequences in flight in a scratch context).
    pub spans: usize,
}

/// The next decode of a continuous prefill: the prompts' remaining tokens in queue order
/// (`span.item` indexes `prompts`), as many as `room` holds. A prompt is finished in order:
/// where no output is left, the chunk takes all of the next prompt but its last token and
/// ends, so later prompts never overtake an earlier one. Empty when nothing is left (or
/// `room` holds nothing).
pub fn plan_chunk(prompts: &[Progress], room: ChunkRoom) -> Chunk {
    let mut chunk = Chunk::default();
    let (mut tokens, mut outputs) = (room.tokens, room.outputs);
    for (item, p) in prompts.iter().enumerate() {
        let left = p.len.saturating_sub(p.done);
        if left == 0 {
            continue;
        }
        if tokens == 0 || chunk.spans.len() == room.spans {
            break;
        }
        let mut take = left.min(tokens);
        let finishes = take == left;
        if finishes && outputs == 0 {
            take -= 1; // its last token waits for a decode with an output free
        }
        if take > 0 {
            chunk.spans.push(Span {
                item,
                start: p.done,
                len: take,
                is_last: finishes && outputs > 0,
            });
        }
        if !finishes || outputs == 0 {
            break;
        }
        tokens -= take;
        outputs -= 1;
    }
    chunk
}

/// Position, within the flattened chunk, of the last token of span `span_idx`:
/// the batch row whose logits belong to that span.
///
/// # Panics
/// If `span_idx` is out of range or the span is empty.
pub fn logits_index(chunk: &Chunk, span_idx: usize) -> usize {
    let before: usize = chunk.spans[..span_idx].iter().map(|s| s.len).sum();
    let len = chunk.spans[span_idx].len;
    assert!(len > 0, "empty span has no last token");
    before + len - 1
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(item: usize, start: usize, len: usize, is_last: bool) -> Span {
        Span {
            item,
            start,
            len,
            is_last,
        }
    }

    #[test]
    fn splits_across_chunks() {
        let chunks = plan_prefill(&[5, 0, 3, 4], 4);
        assert_eq!(chunks.len(), 3);
        assert_eq!(chunks[0].spans, [span(0, 0, 4, false)]);
        assert_eq!(chunks[1].spans, [span(0, 4, 1, true), span(2, 0, 3, true)]);
        assert_eq!(chunks[2].spans, [span(3, 0, 4, true)]);
        assert_eq!(chunks[1].n_tokens(), 4);
        assert_eq!(logits_index(&chunks[1], 0), 0);
        assert_eq!(logits_index(&chunks[1], 1), 3);
    }

    #[test]
    fn empty_inputs() {
        assert!(plan_prefill(&[], 8).is_empty());
        assert!(plan_prefill(&[0, 0], 8).is_empty());
    }

    #[test]
    fn exact_fit() {
        let chunks = plan_prefill(&[2, 2], 2);
        assert_eq!(chunks.len(), 2);
        assert!(chunks
            .iter()
            .all(|c| c.spans.len() == 1 && c.spans[0].is_last));
    }

    #[test]
    #[should_panic(expected = "n_batch")]
    fn zero_batch_panics() {
        plan_prefill(&[1], 0);
    }
}
