"""Microbenchmarks of single mechanisms: tier I/O, the store on loopback, page layouts, the cost
of one scheduler step."""
