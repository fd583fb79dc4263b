//! A budget on request-body bytes buffered at once, one per port: the gRPC port's is shared by
//! every ext_proc stream and Pick message, the admin port's by explain inputs. Past it a stream's
//! next chunk is refused with a fast 503 instead of growing memory (1,500 streams each holding
//! 1 MiB once took RSS to 3 GB).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Shared by every stream of one service.
#[derive(Debug, Clone)]
pub struct BodyBudget {
    used: Arc<AtomicUsize>,
    limit: usize,
}

impl BodyBudget {
    /// At most `limit` bytes buffered at once.
    pub fn new(limit: usize) -> Self {
        Self {
            used: Arc::new(AtomicUsize::new(0)),
            limit,
        }
    }

    /// Bytes buffered now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// An empty reservation against this budget.
    pub fn reservation(&self) -> Reservation {
        Reservation {
            budget: self.clone(),
            held: 0,
        }
    }
}

/// Bytes one stream holds; returned when released or dropped.
#[derive(Debug)]
pub struct Reservation {
    budget: BodyBudget,
    held: usize,
}

impl Reservation {
    /// Takes `n` more bytes, or nothing when the budget would be exceeded.
    pub fn grow(&mut self, n: usize) -> bool {
        let b = &self.budget;
        let ok = b
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                u.checked_add(n).filter(|&t| t <= b.limit)
            })
            .is_ok();
        if ok {
            self.held += n;
        }
        ok
    }

    /// Returns everything held.
    pub fn release(&mut self) {
        self.budget.used.fetch_sub(self.held, Ordering::AcqRel);
        self.held = 0;
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_share_one_limit_and_give_back_on_drop() {
        let budget = BodyBudget::new(100);
        let mut a = budget.reservation();
        let mut b = budget.reservation();
        assert!(a.grow(60));
        assert!(!b.grow(41), "over the shared limit");
        assert!(b.grow(40));
        assert_eq!(budget.used(), 100);
        drop(a);
        assert_eq!(budget.used(), 40);
        b.release();
        assert_eq!(budget.used(), 0);
        assert!(!budget.reservation().grow(usize::MAX), "no overflow");
    }
}
