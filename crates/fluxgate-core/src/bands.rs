//! [`Bands`]: the band reports of a decision, in a vector reused from one decision to the
//! next.

use std::cell::{Cell, RefCell};
use std::fmt;
use std::ops::{Deref, DerefMut};

use crate::decision::BandReport;

/// The most vectors each thread keeps for reuse.
const POOL: usize = 32;
/// Vectors larger than this are not kept.
const MAX_KEPT_CAPACITY: usize = 64;

thread_local! {
    /// The vector dropped last: a thread that decides request after request takes back the
    /// one its last decision gave, without borrowing the pool.
    static LAST: Cell<Option<Vec<BandReport>>> = const { Cell::new(None) };
    static FREE: RefCell<Vec<Vec<BandReport>>> = const { RefCell::new(Vec::new()) };
}

/// The band reports of a decision or of a limiter's outcome: a `Vec<BandReport>` (it
/// derefs to one) whose buffer goes back to a small per-thread pool when it is dropped,
/// and is taken from there by [`with_capacity`](Self::with_capacity). A thread that decides
/// request after request therefore allocates no vector for its decisions after the first
/// ones, while a decision stays as small to move as a `Vec`.
///
/// ```
/// use fluxgate_core::Bands;
/// let bands = Bands::with_capacity(2);
/// assert!(bands.is_empty());
/// assert!(bands.capacity() >= 2);
/// ```
#[derive(Default, PartialEq, Eq)]
pub struct Bands(Vec<BandReport>);

impl Bands {
    /// No reports, without a buffer.
    pub const fn new() -> Self {
        Self(Vec::new())
    }

    /// No reports, with room for `capacity`: a buffer from the thread's pool when there is
    /// one.
    pub fn with_capacity(capacity: usize) -> Self {
        let reused = LAST.try_with(Cell::take).ok().flatten().or_else(|| {
            FREE.try_with(|free| free.try_borrow_mut().ok().and_then(|mut free| free.pop()))
                .ok()
                .flatten()
        });
        let mut v = reused.unwrap_or_default();
        v.reserve(capacity);
        Self(v)
    }

    /// The vector, taken out of the pool's reach.
    pub fn into_vec(mut self) -> Vec<BandReport> {
        std::mem::take(&mut self.0)
    }
}

impl Drop for Bands {
    fn drop(&mut self) {
        let capacity = self.0.capacity();
        if capacity == 0 || capacity > MAX_KEPT_CAPACITY {
            return;
        }
        let mut v = std::mem::take(&mut self.0);
        v.clear();
        // At thread exit the pool may be gone: the vector is then simply freed.
        let Ok(Some(older)) = LAST.try_with(|last| last.replace(Some(v))) else {
            return;
        };
        let _ = FREE.try_with(|free| {
            if let Ok(mut free) = free.try_borrow_mut() {
                if free.len() < POOL {
                    free.push(older);
                }
            }
        });
    }
}

impl Clone for Bands {
    fn clone(&self) -> Self {
        let mut v = Self::with_capacity(self.0.len());
        v.0.extend(self.0.iter().cloned());
        v
    }
}

impl fmt::Debug for Bands {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl Deref for Bands {
    type Target = Vec<BandReport>;
    fn deref(&self) -> &Vec<BandReport> {
        &self.0
    }
}

impl DerefMut for Bands {
    fn deref_mut(&mut self) -> &mut Vec<BandReport> {
        &mut self.0
    }
}

impl From<Vec<BandReport>> for Bands {
    fn from(v: Vec<BandReport>) -> Self {
        Self(v)
    }
}

impl FromIterator<BandReport> for Bands {
    fn from_iter<I: IntoIterator<Item = BandReport>>(iter: I) -> Self {
        let iter = iter.into_iter();
        let mut v = Self::with_capacity(iter.size_hint().0);
        v.0.extend(iter);
        v
    }
}

impl Extend<BandReport> for Bands {
    fn extend<I: IntoIterator<Item = BandReport>>(&mut self, iter: I) {
        self.0.extend(iter);
    }
}

impl IntoIterator for Bands {
    type Item = BandReport;
    type IntoIter = std::vec::IntoIter<BandReport>;
    fn into_iter(self) -> Self::IntoIter {
        self.into_vec().into_iter()
    }
}

impl<'a> IntoIterator for &'a Bands {
    type Item = &'a BandReport;
    type IntoIter = std::slice::Iter<'a, BandReport>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dropped_buffer_is_reused_on_the_same_thread() {
        let first = Bands::with_capacity(3);
        let ptr = first.as_ptr();
        drop(first);
        let second = Bands::with_capacity(1);
        assert_eq!(second.as_ptr(), ptr);
        assert!(second.is_empty());
        // An empty vector without a buffer is not pooled.
        drop(Bands::new());
        assert_eq!(Bands::with_capacity(0).capacity(), 0);
    }
}
