variable "subscription_id" {
  description = "Azure subscription that holds everything below."
  type        = string
}

variable "location" {
  description = "Region of the resource group, the network and every container group (ACI: CPU only)."
  type        = string
  default     = "eastus"
}

variable "resource_group_name" {
  description = "Resource group the aci backend creates its container groups in."
  type        = string
  default     = "physalia"
}

variable "vnet_cidr" {
  description = "Address space of the virtual network."
  type        = string
  default     = "10.1.0.0/16"
}

variable "subnet_cidr" {
  description = "The subnet the coordinator and the workers share (delegated to Container Instances). A /22 holds about 1000 container groups."
  type        = string
  default     = "10.1.0.0/22"
}

variable "quic_ports" {
  description = "UDP ports open inside the subnet: the coordinator's control port and the workers' mesh port (WorkerSpec.network)."
  type        = string
  default     = "7000-7199"
}

variable "registry_id" {
  description = "Resource id of an Azure Container Registry holding the worker image, or null for a public image. When set, a pull identity gets AcrPull on it (AciConfig.registry)."
  type        = string
  default     = null
}

variable "storage_account_name" {
  description = "Name of the job store's storage account (3-24 lowercase letters and digits, unique in Azure)."
  type        = string
}
