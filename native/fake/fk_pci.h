/*
 * The fake node's GPUs by PCI address, shared by the fake driver (cuDeviceGetPCIBusId) and the
 * fake NVML (nvmlDeviceGetPciInfo): physical GPU g sits at domain g / 14, bus 0x18 + 0x11 (g % 14),
 * device 0, function 0, and its UUID is GPU-fa4e0000-0000-0000-0000-<g, 12 digits>. A process's
 * device ordinals name some of these (what its container exposes, narrowed by
 * CUDA_VISIBLE_DEVICES); the PCI address is the same whichever process asks.
 */
#ifndef GH_FK_PCI_H
#define GH_FK_PCI_H

#define FK_PCI_PER_DOMAIN 14
static inline unsigned fk_pci_domain(unsigned g) { return g / FK_PCI_PER_DOMAIN; }
static inline unsigned fk_pci_bus(unsigned g) { return 0x18u + 0x11u * (g % FK_PCI_PER_DOMAIN); }
#define FK_UUID_FMT "GPU-fa4e0000-0000-0000-0000-%012u"

#endif
