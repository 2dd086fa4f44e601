//! Header values written without an allocation of their own.
//!
//! A `HeaderValue` owns its bytes through a `Bytes`; made from a number or a string it
//! allocates for each response. Here each thread writes its values one after the other into
//! a chunk of [`CHUNK`] bytes, and each value is a slice of that chunk: writing one costs a
//! copy and a reference count, and a new chunk is allocated only when the current one is
//! used up (about once per hundred responses). A chunk is freed when the last response
//! holding one of its values is dropped, so a response kept for long holds at most one
//! chunk.

use std::cell::RefCell;

use bytes::BytesMut;
use http::HeaderValue;

/// The size of a thread's chunk.
const CHUNK: usize = 8 * 1024;

thread_local! {
    static CURRENT: RefCell<BytesMut> = RefCell::new(BytesMut::new());
}

/// A value being written, straight into the thread's chunk.
pub(crate) struct ValueBuf<'a> {
    chunk: &'a mut BytesMut,
}

impl ValueBuf<'_> {
    /// Appends bytes. The chunk grows if it must (it is then renewed after this value).
    pub(crate) fn push(&mut self, bytes: &[u8]) {
        self.chunk.extend_from_slice(bytes);
    }

    pub(crate) fn push_u64(&mut self, n: u64) {
        self.push(itoa::Buffer::new().format(n).as_bytes());
    }
}

/// A header value written by `write`. Only visible ASCII is ever written (numbers, ids,
/// labels and punctuation), so it is always valid; an empty value stands in otherwise.
pub(crate) fn value(write: impl FnOnce(&mut ValueBuf<'_>)) -> HeaderValue {
    let finish = |chunk: &mut BytesMut| {
        HeaderValue::from_maybe_shared(chunk.split().freeze()).unwrap_or_else(|_| HeaderValue::from_static(""))
    };
    let mut write = Some(write);
    let mut run = |chunk: &mut BytesMut| {
        if let Some(write) = write.take() {
            write(&mut ValueBuf { chunk });
        }
        finish(chunk)
    };
    let from_chunk = CURRENT.try_with(|current| {
        let mut chunk = current.borrow_mut();
        // Room for the usual value; a longer one makes the chunk grow.
        if chunk.capacity() - chunk.len() < 128 {
            // The old chunk lives on in the values cut from it.
            *chunk = BytesMut::with_capacity(CHUNK);
        }
        run(&mut chunk)
    });
    // At thread exit, without the chunk: a value of its own.
    from_chunk.unwrap_or_else(|_| run(&mut BytesMut::new()))
}

/// A number as a header value.
pub(crate) fn number(n: u64) -> HeaderValue {
    value(|v| v.push_u64(n))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_survive_new_chunks_and_long_values() {
        let mut kept = Vec::new();
        for n in 0..5_000u64 {
            kept.push((n, number(n * 1_000_003)));
        }
        for (n, v) in &kept {
            assert_eq!(v.to_str().unwrap(), (n * 1_000_003).to_string());
        }
        let long = value(|v| {
            for _ in 0..1_000 {
                v.push(b"\"rule\";r=1;");
            }
        });
        assert_eq!(long.len(), 11_000);
        assert_eq!(number(42), "42");
        assert_eq!(value(|v| v.push(b"a\nb")), "");
        assert_eq!(number(7), "7");
    }
}
