package ingest

// InPlace is the consumer's mapping of the whole region and the sequence
// number of the next buffer it would take, for a consumer that reads and
// releases buffers in place by itself: a GPU kernel that polls the
// descriptors in host memory registered for device access. While such a
// consumer runs, Next, Poll and Release must not be used; Close still
// detaches (and unmaps the region: stop the kernel first).
func (c *Consumer) InPlace() (region []byte, next uint64) { return c.mem, c.next }
